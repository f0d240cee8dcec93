"""Chat templates, public: ``ggraph.chat.render(template, messages, ...)`` renders a Hugging Face chat template
exactly as transformers does, in a sandbox with limits (see ggraph.runtime.chat)."""
from ggraph.runtime.chat import ChatTemplateError, render

__all__ = ["render", "ChatTemplateError"]
