import os

# numba compiles the codec kernels once and caches them next to the sources.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))
