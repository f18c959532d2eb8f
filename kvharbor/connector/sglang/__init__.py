"""kvharbor inside SGLang: the HiCache storage backend and ``KVHARBOR=1`` activation.

SGLang's hierarchical cache keeps KV pages in GPU memory, then in a host pool,
then in a storage backend; kvharbor is that backend (`backend.KVHarborStorage`),
loaded as ``--hicache-storage-backend dynamic`` and talking to the gateway through
the same `kvharbor.connector.link.CacheLink` as the vLLM connector.

How SGLang pages map onto kvharbor objects (`keys`): one stored object per SGLang
page, so the chunk size is SGLang's ``--page-size``. SGLang hands the backend a
chained SHA-256 hash per page (it stands for the whole prefix up to that page),
never the token ids, so kvharbor's key of a page is that hash inside kvharbor's
layout fingerprint (`kvharbor.cache.keys.engine_page_key`). The fingerprint is
fixed when SGLang registers its host pool: model, tp rank and size, pipeline and
context-parallel ranks, page size, host layout and KV dtype and shapes; a change
of any of them never hits and never reads a wrong byte. Grouping pages into
larger chunks was not chosen: SGLang asks for pages, checks them one by one, and
evicts them one by one; a chunk of several pages would be read whole for its
first page.

Importing this package imports nothing from SGLang; `backend` and `activation`'s
hooks do.
"""
