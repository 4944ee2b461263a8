"""atom-kv: KV-cache transfer for prefill/decode disaggregated LLM serving.

Importing the package is cheap and never touches optional hardware
libraries; subpackages are imported on demand.
"""

__version__ = "0.1.0"
