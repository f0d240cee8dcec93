"""Conversation: a chat whose history stays in a Session's KV cache.

Each turn renders the whole conversation with the model's chat template, keeps the cached
tokens it starts with, and prefills only the rest: in a steady conversation that is the
template's end of the last reply and the new user turn. When the next prompt would leave
fewer than ``reserve`` tokens for the reply, the oldest exchanges (after the system message)
are dropped, the cache is rebuilt from what is left, and ``notes`` hears about it.

    conv = Conversation(Session("model.gguf"), system="Be brief.", temperature=0)
    for piece in conv.send("What is a GGUF file?"):
        print(piece, end="")
"""
from __future__ import annotations

from typing import Callable, Iterator

from ggraph.runtime.session import ContextFullError, Session


class Conversation:
    """Messages so far and the session that holds them; ``send`` streams the next reply.

    ``max_tokens`` caps each reply (-1: until the end of the turn or a full context);
    ``reserve`` is the room a prompt must leave for its reply (default: ``max_tokens``, or a
    quarter of the context when replies are uncapped). ``sampling`` goes to Session.generate.
    """

    def __init__(self, session: Session, system: str | None = None, *, max_tokens: int = -1,
                 reserve: int | None = None, notes: Callable[[str], None] | None = None, **sampling):
        self.session = session
        self.max_tokens = max_tokens
        quarter = max(1, session.ctx // 4)
        self.reserve = reserve if reserve is not None else (min(max_tokens, quarter) if max_tokens >= 0 else quarter)
        self.notes = notes or (lambda text: None)
        self.sampling = sampling
        self.system = system
        self.turns: list[dict] = []                      # user and assistant messages, oldest first
        self.stats: dict = {}                            # the last turn's: Session.stats plus dropped_turns

    @property
    def messages(self) -> list[dict]:
        """What the template renders: the system message (if any), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        """Forget every turn (the system message stays) and the cache."""
        self.turns = []
        self.session.reset()

    def set_system(self, text: str | None) -> None:
        """A new system message (None or "" for none); checked by rendering it, kept only if it renders."""
        old, self.system = self.system, text or None
        try:
            self.session.chat_ids(self.messages + [{"role": "user", "content": "hi"}])
        except Exception:
            self.system = old
            raise

    def send(self, text: str) -> Iterator[str]:
        """Add a user turn and stream the reply; the reply (or as much as was made) joins the turns.

        A message that cannot fit even alone raises ContextFullError, and the conversation stays as it was.
        """
        user = {"role": "user", "content": text}
        ids, kept = self._fit(user)
        before, dropped = self.turns, (len(self.turns) - len(kept)) // 2
        self.turns = kept + [user]
        if dropped:
            self.notes(f"the context is full: dropped the {dropped} oldest exchange{'s' * (dropped != 1)}; "
                       f"the cache was rebuilt from the {len(kept) // 2} left")
        reply = {"role": "assistant", "content": ""}
        try:
            for piece in self.session.generate(ids, max_tokens=self.max_tokens, stream=True, reuse_cache=True,
                                               **self.sampling):
                reply["content"] += piece
                yield piece
        except Exception:
            if not reply["content"]:                     # nothing said: the turn did not happen
                self.turns = before
                raise
            self.turns.append(reply)
            raise
        except BaseException:                            # interrupted (Ctrl-C, or the reader stopped)
            self.turns.append(reply)
            raise
        self.turns.append(reply)
        self.stats = dict(self.session.stats, dropped_turns=dropped)
        if self.session.stats.get("stop") == "context":
            self.notes(f"the context is full (ctx={self.session.ctx}): the reply stopped at "
                       f"{self.session.stats['generated_tokens']} tokens; the oldest turns make room next time")

    def _fit(self, user: dict) -> tuple[list[int], list[dict]]:
        """The prompt ids with ``user`` added and the turns kept: the oldest exchanges go until the reply
        has ``reserve`` tokens of room. Nothing changes if even ``user`` alone cannot fit."""
        ctx, head = self.session.ctx, self.messages[:len(self.messages) - len(self.turns)]
        turns = list(self.turns)
        while True:
            ids = self.session.chat_ids(head + turns + [user])
            if len(ids) + self.reserve <= ctx:
                return ids, turns
            if not turns:
                if len(ids) < ctx:                       # no history left to drop: the reply gets what remains
                    return ids, turns
                raise ContextFullError(f"the message is too long: with the template it is {len(ids)} tokens, "
                                       f"and the context holds {ctx} (--ctx raises it)")
            del turns[:2]                                # a user turn and its reply
