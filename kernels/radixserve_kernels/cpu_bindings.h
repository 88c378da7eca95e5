// Each source file registers its own Python bindings; cpu_module.cpp calls them all.
#pragma once
#include <torch/extension.h>

void bind_cpu_attention(pybind11::module& m);  // cpu_attention.cpp: paged decode and extend attention
void bind_cpu_fused_ops(pybind11::module& m);  // cpu_fused_ops.cpp: norms, activation, rotary, KV store
void bind_cpu_linear(pybind11::module& m);     // cpu_linear.cpp: the packed float32 GEMM
void bind_cpu_decoder(pybind11::module& m);    // cpu_decoder.cpp: the decoder layers in one call
void bind_cpu_quant(pybind11::module& m);     // cpu_quant.cpp: the FP8 weight GEMM
void bind_cpu_recurrent(pybind11::module& m); // cpu_recurrent.cpp: hybrid models' recurrent steps
void bind_cpu_sparse_attention(pybind11::module& m);  // cpu_sparse_attention.cpp: DSA's selected rows
