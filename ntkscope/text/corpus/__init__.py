"""Real text for the long-tail story: one loader per source, and corpus packs."""

from ntkscope.text.corpus.pack import PROBE_TASKS, CorpusPack, ProbeTask, build_pack, load_pack
from ntkscope.text.corpus.sources import SOURCES, Source, SourceMissingError, load_source
from ntkscope.text.corpus.text import Record, split_sentences

__all__ = ["PROBE_TASKS", "SOURCES", "CorpusPack", "ProbeTask", "Record", "Source", "SourceMissingError",
           "build_pack", "load_pack", "load_source", "split_sentences"]
