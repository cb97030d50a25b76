"""Corpora (PTB, WikiText-2), vocabulary, batching, sharding and prefetch."""
from .batching import (BPTTTrainStream, LMBatch, Prefetcher, SentenceTrainStream, StepBatch, batch_source,
                       bptt_eval_batches, move_to, sentence_eval_batches)
from .corpus import CORPORA, Corpus, Split, Vocab, ensure_corpus, load_corpus, resolve_data_dir

__all__ = ["BPTTTrainStream", "LMBatch", "Prefetcher", "SentenceTrainStream", "StepBatch", "batch_source",
           "bptt_eval_batches", "move_to", "sentence_eval_batches", "CORPORA", "Corpus", "Split", "Vocab",
           "ensure_corpus", "load_corpus", "resolve_data_dir"]
