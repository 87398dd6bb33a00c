"""llm_from_scratch: build a GPT-style language model from nothing, then align it.

One concept per module, in chapter order (see README.md). Modules are imported
explicitly (``from llm_from_scratch.tokenizer import Tokenizer``); this file
imports nothing so that any module can be copied out with only the few files it
needs.
"""

__version__ = "0.1.0"
