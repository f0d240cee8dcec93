"""Chat templates, public: ``ggraph.chat.render(template, messages, ...)`` renders a Hugging Face chat template
exactly as transformers does, in a sandbox with limits (see ggraph.runtime.chat_template)."""
from ggraph.runtime.chat_template import ChatTemplateError, render

__all__ = ["render", "ChatTemplateError"]
