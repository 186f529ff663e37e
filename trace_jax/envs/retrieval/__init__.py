"""Retrieval: BM25 over a local corpus (`bm25`), the HTTP client of a `POST /retrieve` server
(`http_client`), that server (`server`) and its wire format (`wire`)."""
