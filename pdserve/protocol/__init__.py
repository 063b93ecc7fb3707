"""What crosses a process boundary, with no torch and no I/O: the worker control API's
bodies, sampling parameters, reservation signing, and a request's state machine and timeline.

The router, the workers and the tools all import it; it imports nothing of pdserve but
`errors`, `clock` and `auth` (a test keeps it that way, and keeps torch out of the router).
"""
