"""GPU memory between processes: probing the devices, CUDA IPC handles, device output slots,
DLPack.
"""
