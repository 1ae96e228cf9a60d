// The one place every fdc op schema is declared. Backends register implementations in csrc/cpu and csrc/cuda
// (TORCH_LIBRARY_IMPL); fake (meta) implementations are registered in Python, fdc_ops/ops.py, with the docstrings.
#include <Python.h>
#include <torch/library.h>

// fdc_ops._C is loaded for its op registrations only: an empty module keeps Python's import machinery happy, with
// no pybind11 (ops go through torch.library).
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(fdc, m) {
  m.def("rotate_compress(Tensor x, Tensor rot, Tensor qk_offsets, int group, int? out_width=None) -> Tensor");
  m.def(
      "rope_rotate_compress(Tensor x, Tensor cos, Tensor sin, Tensor rot, Tensor qk_offsets, int group, "
      "int? out_width=None) -> Tensor");
  m.def(
      "prefill_plan(Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor qk_offsets, Tensor v_offsets, int group, "
      "bool causal, int? num_workers=None, int row_block=64, int window_left=-1) -> Tensor");
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor qk_offsets, Tensor v_offsets, int group, float scale, bool causal, Tensor? plan=None, "
      "int window_left=-1, float softcap=0.0, Tensor? sinks=None, Tensor? block_table=None) -> Tensor");
  m.def(
      "decode_plan(Tensor cache_seqlens, Tensor qk_offsets, Tensor v_offsets, int group, int? num_workers=None, "
      "int window_left=-1) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor qk_offsets, "
      "Tensor v_offsets, int group, float scale, Tensor? plan=None, Tensor? block_table=None, int window_left=-1, "
      "float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def(
      "append_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor cu_seqlens, "
      "Tensor cache_seqlens, Tensor qk_offsets, Tensor v_offsets, Tensor? block_table=None) -> ()");
  m.def(
      "window_scores(Tensor q, Tensor cu_seqlens_q, Tensor k_cache, Tensor cache_seqlens, Tensor qk_offsets, "
      "int group, float scale, int window, float softcap=0.0, Tensor? noise_state=None, float temperature=1.0) "
      "-> Tensor");
}
