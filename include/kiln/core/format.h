// Sizes and durations for a person to read: the one format every message,
// table, progress line and report of kiln uses.
#pragma once

#include <string>

namespace kiln {

/// "512 B", "16.0 KiB", "1.5 MiB", "2.3 GiB" (one decimal from KiB up).
std::string format_bytes(double bytes);

/// "28.7 s", "3 min 05 s", "2 h 10 min"; "n/a" when not finite or negative (an unknown ETA).
std::string format_duration(double seconds);

}  // namespace kiln
