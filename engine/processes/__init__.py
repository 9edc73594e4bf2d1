"""Worker processes: spawning them (directly or through the fork server), supervising them, and
what a death means.
"""
