// The extension module: every kernel file's bindings (cpu_bindings.h).
#include <torch/extension.h>
#include "cpu_bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_cpu_attention(m);
  bind_cpu_fused_ops(m);
  bind_cpu_linear(m);
  bind_cpu_decoder(m);
  bind_cpu_quant(m);
  bind_cpu_recurrent(m);
  bind_cpu_sparse_attention(m);
}
