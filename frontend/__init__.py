"""shmserve.frontend"""
