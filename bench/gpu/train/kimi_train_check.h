// Kimi Linear trained on the GPU (train/cuda/kimi_cuda_model.h) against the CPU
// KimiLinearTrainable (fp32, the reference). kda_gpu_train --check calls it.
#pragma once

// Prints "CHECK <name> PASS|FAIL rel=<x> tol=<y>" lines; returns the number of failures.
int run_kimi_train_checks();
