"""LiveRequest: one request in flight on the vLLM backend, and its deltas turned into agentx's.

Owned by the backend's loop thread (under its step lock). Text and stop strings are agentx's
(:class:`~agentx.engine.text_state.TextState`): vLLM streams token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentx.engine.outputs import RequestOutput
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.engine.text_state import TextState
from agentx.engine.vllm.convert import finish_of, logprobs_of

__all__ = ["LiveRequest"]


@dataclass(slots=True)
class LiveRequest:
    stream: RequestStream
    prompt: list[int]
    sampling: SamplingParams
    options: RequestOptions
    text: TextState
    affinity: str  # the session lineage (sticky data-parallel rank)
    num_cached: int = 0
    num_output: int = 0
    prompt_logprobs_sent: bool = False

    def take(self, out) -> tuple[RequestOutput, bool]:
        """agentx's delta for vLLM's ``out`` (a DELTA-kind ``vllm.RequestOutput``), and whether
        a stop string ended the request here (vLLM does not know: the caller aborts it)."""
        if self.num_output == 0 and out.num_cached_tokens is not None:
            self.num_cached = out.num_cached_tokens  # vLLM's own count, on the first delta
        completion = out.outputs[0] if out.outputs else None
        new_ids = list(completion.token_ids) if completion is not None else []
        self.num_output += len(new_ids)
        finish, stop = finish_of(
            completion.finish_reason if completion is not None and out.finished else None,
            completion.stop_reason if completion is not None else None,
            new_ids,
        )
        text_ids = new_ids
        if isinstance(stop, int) and not self.text.include_stop:
            text_ids = new_ids[:-1]  # an EOS or stop token ends the text, it is not text
        new_text = self.text.push(text_ids)
        stop_string = self.text.matched is not None and finish is None
        if stop_string:
            finish, stop = "stop", self.text.matched
        if finish is not None:
            new_text += self.text.flush()
        prompt_lps = ()
        if not self.prompt_logprobs_sent and getattr(out, "prompt_logprobs", None):
            prompt_lps = logprobs_of(
                out.prompt_logprobs, self.prompt, self.sampling.prompt_logprobs
            )
            self.prompt_logprobs_sent = True
        delta = RequestOutput(
            request_id=out.request_id,
            new_token_ids=new_ids,
            finish_reason=finish,
            stop_reason=stop,
            num_prompt_tokens=len(self.prompt),
            num_cached_tokens=self.num_cached,
            num_output_tokens=self.num_output,
            new_text=new_text,
            logprobs=logprobs_of(
                completion.logprobs if completion is not None else None,
                new_ids,
                self.sampling.logprobs,
            ),
            prompt_logprobs=prompt_lps,
        )
        return delta, stop_string
