"""The same processor as processor.py, as an asyncio coroutine: each record
awaits a (simulated) remote lookup; the package runs the records of different
keys of a call concurrently and those of one key in order, so the count per
key stays exact.

    pip install ./client/python
    python examples/python-processor/async_processor.py 127.0.0.1:7000 [LOOKUP_MS]
"""

import asyncio
import sys

from taskstream import processor as tp

LOOKUP_S = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.002


async def enrich(record, call):
    if record.key is None:
        return None
    try:
        text = record.value.decode("utf-8")
    except UnicodeDecodeError:
        return tp.Failure("NotUtf8", "value is not UTF-8", retryable=False)
    await asyncio.sleep(LOOKUP_S)  # a remote call that holds no thread
    count = int(call.state.get(record.key) or 0) + 1
    key = record.key.decode("utf-8", "replace")
    enriched = tp.output(f"{text.upper()} (#{count} of {key})", key=record.key,
                         headers=[("source-offset", str(record.offset))])
    return tp.Success([tp.put(record.key, str(count))], [enriched])


if __name__ == "__main__":
    tp.serve(enrich, sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7000")
