"""shmserve.engine"""
