"""Token generation for causal LMs: overdrive's decoder with a pre-allocated KV cache (`decoder`) and the
engine that prefills and decodes batches of prompts (`engine`)."""

from overdrive.generate.decoder import Decoder, DecoderConfig, KVCache
from overdrive.generate.engine import Completion, Generator, SamplingParams, TokenLogprob
from overdrive.generate.speculative import DraftModel, PromptLookup

__all__ = ["Completion", "Decoder", "DecoderConfig", "DraftModel", "Generator", "KVCache", "PromptLookup",
           "SamplingParams", "TokenLogprob"]
