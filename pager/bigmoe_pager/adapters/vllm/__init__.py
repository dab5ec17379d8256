"""The pager's adapters to vLLM: everything that imports vLLM lives here.

process.py   PagerProcess: what the expert pager holds in one vLLM process (made once by install)
experts.py   the paged RoutedExperts (and the replay-only one), registered in vLLM's place
device.py    device-driven paging (CUDA graphs) and its per-process parts
glue.py      what the paged layer needs from vLLM: numbering, engine mode, kernel rules, slots
routing.py   routing trace and replay
ssd_source.py the SSD tier's stores, seen per layer
stats.py     counters summed in-process and exported to Prometheus
ngram.py     the n-gram (PLE) table pager's install: vLLM's storage classes and loader rebound
ngram_process.py NgramProcess: what the n-gram pager holds in one vLLM process; finding and opening its table
ngram_layer.py the paged PLE embedding layer (imports vLLM's Qwen4Exp, so loaded only once that is checked)
"""
