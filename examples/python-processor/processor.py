"""A taskstream processor in Python, written with the taskstream package
(client/python): it enriches each record and counts records per key through
state operations; a value that is not UTF-8 fails, not retryable, so it goes
straight to the dead-letter topic.

    pip install ./client/python
    python examples/python-processor/processor.py 127.0.0.1:7000

beside a server running examples/python-processor/taskstream.toml.
"""

import sys

from taskstream import processor as tp


def enrich(record, call):
    if record.key is None:
        return None
    try:
        text = record.value.decode("utf-8")
    except UnicodeDecodeError:
        return tp.Failure("NotUtf8", "value is not UTF-8", retryable=False)
    # call.state holds the store's count of each key of this call
    # (include_state = true), updated with this call's earlier records.
    count = int(call.state.get(record.key) or 0) + 1
    key = record.key.decode("utf-8", "replace")
    enriched = tp.output(f"{text.upper()} (#{count} of {key})", key=record.key,
                         headers=[("source-offset", str(record.offset))])
    return tp.Success([tp.put(record.key, str(count))], [enriched])


if __name__ == "__main__":
    tp.serve(enrich, sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7000")
