"""The results file: its keys (``keys``), its documents (``schema``) and the file on disk (``store``)."""

from mac_moesd.results.keys import pair_key, pair_spec_key, parse_point_key, point_key, spec_key
from mac_moesd.results.schema import READS, SCHEMA, upgrade
from mac_moesd.results.store import (ResultsBusy, ResultsStore, WriterLock, ensure_writable, incompatibility,
                                     load_results, write_atomic)

__all__ = ["READS", "SCHEMA", "ResultsBusy", "ResultsStore", "WriterLock", "ensure_writable", "incompatibility",
           "load_results", "pair_key", "pair_spec_key", "parse_point_key", "point_key", "spec_key", "upgrade",
           "write_atomic"]
