// safetensors reader/writer (being written; see include/kiln/io/safetensors.h).
namespace kiln::io {}
