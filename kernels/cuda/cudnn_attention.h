// cudnn_attention.h — causal attention by cuDNN's fused flash-attention engines (cudnn_attention.cpp), the
// run-time alternative to flash_attention.cu under bf16 at any head size that is a multiple of 8 (the flash kernels
// take 32 and 64; attention.cu's batched GEMMs the rest), with the flash kernels' interface: q, k and v read in place from qkv (B,T,3C) in bf16, the output and its gradient (B,T,C) in
// bf16, dqkv (B,T,3C) in bf16 overwritten, and the same saved floats: the natural-log log-sum-exp of each row's
// scaled scores, (B,NH,T) — what cuDNN calls the softmax stats, and what the flash kernels save. So either
// direction may run on either implementation.
//
// Chosen by STRATA_ATTENTION=flash|cudnn (environment, read at the first call; default flash until a GPU has
// measured cuDNN's; anything else stops the process naming it). With cudnn chosen, the first call of each shape
// loads cuDNN (cudnn_graph.h says where from) and builds both directions' execution plans; where that fails
// (no cuDNN, a version or GPU without a fused engine for the shape) attention.cu's other paths run instead, and the
// reason is logged once per shape and kept for cudnn_attention_runs().
#pragma once

#include <cstdint>
#include <string>

namespace strata::kernels::cuda {

bool cudnn_attention_chosen();  // STRATA_ATTENTION
void set_cudnn_attention_chosen(bool chosen);  // overrides it (tests)

// Whether cuDNN runs this shape: its plans are built (at the first ask per shape) or were; else false, with why not
// in *why (when not null). Free of Status (and so of fmt) because attention.cu includes it.
bool cudnn_attention_runs(int B, int T, int NH, int hs, std::string* why = nullptr);

// Which of cuDNN's backward forms is tried first: the deterministic one (default: the same bits every run, as the
// rest of the backend; its workspace holds dP, B·NH·T² bf16) or, with STRATA_CUDNN_DETERMINISTIC=0, the one that
// accumulates dQ in fp32 with atomics (the frontend's and PyTorch's default; no dP traffic). Read at the first
// call; set_ overrides it (tests: plans are kept per shape and choice).
bool cudnn_attention_deterministic();
void set_cudnn_attention_deterministic(bool deterministic);

// How many forwards and backwards have run on cuDNN in this process (tests).
uint64_t cudnn_attention_calls();

// Whether the shape's backward is cuDNN's deterministic form (the same bits every run), where it runs.
bool cudnn_attention_reproducible(int B, int T, int NH, int hs);

// Builds the operation graphs of both directions (each form this file may try) and has cuDNN finalize them
// without a device or handle: what can be checked where there is no GPU (cuDNN checks each descriptor and the
// graph's consistency; choosing an engine needs the GPU). True, or false with cuDNN's complaint in *why.
bool cudnn_attention_graphs_finalize(int B, int T, int NH, int hs, std::string* why = nullptr);

// Builds both directions' plans for the GPU `device_json` describes (cudnn::device_properties_json, recorded on it)
// without that GPU: cuDNN chooses the engines it would and compiles their kernels; with the driver's stub library
// standing in for the driver, only loading them fails, and that counts as done. True with which engine
// configurations in *how, or false with why not.
bool cudnn_attention_plans_for_device(const std::string& device_json, int B, int T, int NH, int hs,
                                      std::string* how = nullptr);

// As flash_attention_forward/backward (flash_attention.h); callable only where cudnn_attention_runs is true.
void cudnn_attention_forward(uint16_t* out, const uint16_t* qkv, float* lse, int B, int T, int NH, int hs);
void cudnn_attention_backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
                              const float* lse, int B, int T, int NH, int hs);

}  // namespace strata::kernels::cuda
