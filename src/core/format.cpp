// Sizes and durations for a person to read. See include/kiln/core/format.h.
#include "kiln/core/format.h"

#include <cmath>
#include <cstdio>

namespace kiln {

std::string format_bytes(double bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  char buf[48];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f B", v);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "n/a";
  char buf[64];
  if (s < 60)
    std::snprintf(buf, sizeof buf, "%.1f s", s);
  else if (s < 3600)
    std::snprintf(buf, sizeof buf, "%d min %02d s", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  else
    std::snprintf(buf, sizeof buf, "%d h %02d min", static_cast<int>(s) / 3600, static_cast<int>(s) % 3600 / 60);
  return buf;
}

}  // namespace kiln
