// Stateful: the interface through which anything that is neither a module nor
// an optimizer (AMP's GradScaler, a curriculum, an EMA of the loss) hands its
// state to a checkpoint and takes it back. It lives in io, beside state dicts,
// so that a layer can make its objects checkpointable without depending on the
// checkpoint code above it (kiln/train/checkpoint.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>

#include "kiln/core/tensor.h"

namespace kiln::io {

/// A JSON-able scalar of an object's state; saved exactly (doubles bit for bit).
using StateValue = std::variant<bool, int64_t, double, std::string>;

/// The state of a Stateful object: tensors (stored in the file, checksummed)
/// and scalars (stored in the metadata), each by key.
struct ObjectState {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, StateValue> values;
};

/// The current state_dict() is the schema a checkpoint is validated against:
/// the same keys, the same value kinds, tensors of the same shape and dtype.
/// load_state_dict is called only with a state that passed that check and
/// should not fail on one.
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual ObjectState state_dict() const = 0;
  virtual void load_state_dict(const ObjectState& state) = 0;
  /// True for an object whose saved keys and shapes depend on the run that
  /// saved it (a per-rank state saved at another world size): a checkpoint
  /// then hands load_state_dict whatever was saved under its name without
  /// comparing it with state_dict(), and the object decides what it can use.
  virtual bool loads_any_saved_state() const { return false; }
};

}  // namespace kiln::io
