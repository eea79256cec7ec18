// Messages built without iostreams. A toolchain that links libstdc++ statically into the module
// (seen on the GPU machine: its g++ does) gives the module its own copy of the iostream and
// locale code, and formatting a number through that copy crashed in a process that had also
// loaded the system's libstdc++ (torch). std::to_string goes through the C library instead.
#pragma once
#include <string>
#include <string_view>
#include <type_traits>

namespace tmrun {

namespace detail {
template <class T>
void append(std::string& out, const T& part) {
  if constexpr (std::is_same_v<T, bool>) {
    out += part ? "true" : "false";
  } else if constexpr (std::is_same_v<T, char>) {
    out += part;
  } else if constexpr (std::is_integral_v<T> || std::is_floating_point_v<T>) {
    out += std::to_string(part);
  } else if constexpr (std::is_enum_v<T>) {
    out += std::to_string(static_cast<std::underlying_type_t<T>>(part));
  } else {
    out += std::string_view(part);
  }
}
}  // namespace detail

// Concatenates strings, characters and numbers (decimal) into one string.
template <class... Parts>
std::string str_cat(const Parts&... parts) {
  std::string out;
  (detail::append(out, parts), ...);
  return out;
}

}  // namespace tmrun
