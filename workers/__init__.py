"""shmserve.workers"""
