"""pagedserve: an OpenAI-compatible LLM server split into services over Redis Streams.

The repository keeps `services/`, `kernels/` and `shared/` at its top; `pagedserve/` links them in
so that they install and import as `pagedserve.services`, `pagedserve.kernels`, `pagedserve.shared`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagedserve")
except PackageNotFoundError:  # run from a source tree that was never installed (the GPU box)
    __version__ = "0+unknown"
