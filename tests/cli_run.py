"""Run the ``ggraph`` command line in the test process: one helper for every CLI test file."""
from ggraph.cli import main


def cli(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``ggraph ARGV``, argparse's exits included."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err
