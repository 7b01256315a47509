"""Stubs generated from proto/taskstream/v1 by grpcio-tools (client/python/generate.py);
do not edit: tests/test_stubs.py fails when they differ from what proto/ generates."""
