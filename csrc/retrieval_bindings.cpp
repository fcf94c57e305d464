// pybind11 registration of the step-retrieval backends (filled in by the retrieval issue).
#include "rapo/registry.h"

namespace rapo {
void register_retrieval(pybind11::module_& m) { (void)m; }
}  // namespace rapo
