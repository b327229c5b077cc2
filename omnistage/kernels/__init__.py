"""Every Triton kernel, with the torch-side code that is part of launching it (tiles, grids, autotuning).

The bottom of the package: nothing here imports from omnistage above it. A module that defines kernels imports
Triton at its top, so it is imported only where it runs (on CUDA, or in tests under TRITON_INTERPRET=1): a CPU
install may have no Triton. What CPU code shares with a kernel is in a module without Triton (`moe_bounds`,
`sampling_spec`).
"""
