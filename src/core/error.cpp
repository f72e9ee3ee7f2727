#include "kiln/core/error.h"

namespace kiln::detail {

void throw_internal(const std::source_location& loc, std::string_view cond, const std::string& msg) {
  throw InternalError(concat("internal error (a kiln bug, please report it): ", cond, " failed at ", loc.file_name(),
                             ":", loc.line(), " in ", loc.function_name(), msg.empty() ? "" : ": ", msg));
}

}  // namespace kiln::detail
