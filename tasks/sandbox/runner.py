"""Run one model-written program as `python program.py` would, echoing a final bare expression.

The one runner of both execution paths: the fresh-process path runs this file as the script of a
new interpreter (`python -I -B runner.py CODE_PATH`), and the template's program process calls
`run` after its fork (tasks/sandbox/cell.py). Standard library only, and nothing from the
`tasks` package: under `python -I` the package may not be importable.
"""

import ast
import linecache
import sys
import traceback
import types

# A program that dies of MemoryError exits with this code, so the status comes from the runner's
# own report, never from parsing the program's output. Chosen to collide with no common
# convention (1 = exception, 2 = usage, 120 = flush failure, 128+n = shell signal).
EXIT_MEMORY = 86
PROGRAM_FILENAME = "<code>"

Program = tuple[types.CodeType, types.CodeType | None]


def compile_program(source: str) -> Program:
    """The program's body and its final bare expression (echoed, IPython style), compiled as a
    fresh `python` would compile a script. Raises SyntaxError or ValueError (null bytes)."""
    tree = ast.parse(source, PROGRAM_FILENAME)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), PROGRAM_FILENAME, "eval", dont_inherit=True)
    return compile(tree, PROGRAM_FILENAME, "exec", dont_inherit=True), last


def _report(exc: BaseException, source: str) -> None:
    # Registered only now: tracebacks quote the offending lines, and a call that succeeds should
    # not pay for it.
    linecache.cache[PROGRAM_FILENAME] = (len(source), None, source.splitlines(True), PROGRAM_FILENAME)
    # Skip the runner's frame: the model should see only frames from its own code.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    traceback.print_exception(type(exc), exc, tb)


def run(source: str, program: Program | None = None) -> int:
    """Run `source` as __main__ (from `program`, its compiled form, when given), echo a final bare
    expression, and return the exit code; a program that does not compile gets the compiler's
    message on stderr. One function: in the template every extra call costs the program's
    process page faults (tasks/sandbox/cell.py)."""
    if program is None:
        try:
            program = compile_program(source)
        except (SyntaxError, ValueError) as exc:
            sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
            return 1
    body, last = program
    # A fresh __main__ so that pickling (multiprocessing) finds the program's functions.
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        exec(body, main.__dict__)
        if last is not None:
            value = eval(last, main.__dict__)
            if value is not None:
                print(repr(value))
    except MemoryError as exc:
        main.__dict__.clear()  # free the program's data: formatting the report needs memory
        try:
            _report(exc, source)
        except MemoryError:
            pass
        return EXIT_MEMORY
    except SystemExit as exc:
        # What the interpreter would make of it, had the exception reached the top.
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        return 1
    except BaseException as exc:  # KeyboardInterrupt too: the program failed
        _report(exc, source)
        return 1
    return 0


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        code = f.read()
    # As the template's programs see it (cell.py), not this runner's arguments.
    sys.argv = [""]
    sys.exit(run(code))
