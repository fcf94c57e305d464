// pybind11 registration of the KV-splice backends (filled in by the KV-splice issue).
#include "rapo/registry.h"

namespace rapo {
void register_kv_splice(pybind11::module_& m) { (void)m; }
}  // namespace rapo
