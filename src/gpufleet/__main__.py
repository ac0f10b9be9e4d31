"""``python -m gpufleet`` is the ``gpufleet`` command.

When the command is done the process ends without the interpreter's module teardown
(with torch loaded, seconds that nobody waits for): threads are joined, ``atexit``
handlers run and the output flushed first (see :func:`gpufleet.launch.rankmain.leave`).
"""

from gpufleet.cli import main
from gpufleet.launch.rankmain import leave

code = main()
if not isinstance(code, int):
    raise SystemExit(code)
leave(code)
