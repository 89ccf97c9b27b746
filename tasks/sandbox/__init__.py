"""Code-execution sandbox: status enum, isolated executor, HTTP service, async client.

No re-exports: `python -m tasks.sandbox.server` would otherwise import the server module twice,
and RL code that only needs `ToolStatus` should not pull in aiohttp.
"""
