"""Serving: a KServe v2 / Triton HTTP inference server with dynamic batching, and export
of a trained run to a Triton model repository.

Modules: ``protocol`` (v2 requests and responses, the binary tensor extension),
``model`` (what is served: a run directory, a TorchScript file or a factory),
``batcher`` (the dynamic batching queue), ``metrics`` (Prometheus text), ``app`` (the
ASGI app), ``export`` (the Triton repository). The CLI modules (``cli``, ``export_cli``)
import only the standard library at the top so ``gpufleet --help`` stays fast; this
package's ``__init__`` therefore imports nothing.
"""
