"""Helpers the tests of every layer share: real servers (ckpt-serve, plain llama_cpp.server, redis-server, a slow
link), the library runs of the integrations, fresh home directories and factories for checkpoints and entries.

Imported as ``support.<module>``: tests/ is on ``sys.path`` because tests/conftest.py (the root conftest, outside any
package) puts its directory there, before any test module is collected.
"""
