"""A stand-in for cuda-python in a test server's processes (tests/e2e/test_cuda_shm_cpu.py puts
this directory on their PYTHONPATH): its driver bindings are tests/workers/fake_cuda.py's
ShmIpcDriver, whose CUDA IPC handles name POSIX shared-memory segments."""
