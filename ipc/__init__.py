"""shmserve.ipc"""
