"""The settings dataclasses of the scripts, read from their source with `ast`: nothing is imported (no torch), so a
script can refuse a mistyped flag in a fraction of a second, before its heavy imports, and the docs generator
(dev/gen_docs.py) can write each script's flag table without building the script."""

import ast
import inspect
from pathlib import Path


class Field:
    """A dataclass field; `owner` is the class that defines it first, in `owner_path` (a base may live in another file
    than the class that inherits it, and be imported only there)."""

    def __init__(self, name: str, annotation: str, default: str | None, doc: str, owner: str, owner_path: Path):
        self.name, self.annotation, self.default, self.doc = name, annotation, default, doc
        self.owner, self.owner_path = owner, owner_path


def module_file(repo: Path, importer: Path, module: str, level: int) -> Path | None:
    """The source file of `from <module> import ...` as the scripts run it (framework/ on sys.path)."""
    base = importer.parent if level else repo / "framework"
    for _ in range(max(level - 1, 0)):
        base = base.parent
    candidate = base.joinpath(*module.split(".")) if module else base
    for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
        if path.is_file():
            return path
    return None


_PARSED: dict[Path, tuple[tuple[int, int], ast.Module]] = {}


def parse(path: Path) -> ast.Module:
    """The source's syntax tree, parsed once a process while the file stays as it was (its modification time and size):
    a script's parse of its flags, each --help and each flag page read the same few large files."""
    stat = path.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    if path not in _PARSED or _PARSED[path][0] != version:
        _PARSED[path] = (version, ast.parse(path.read_text(), filename=str(path)))
    return _PARSED[path][1]


def find_class(repo: Path, path: Path, name: str) -> tuple[Path, ast.ClassDef]:
    """A class defined in `path`, or imported into it by name (followed to its definition)."""
    tree = parse(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return path, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(alias.name == name and alias.asname is None for alias in node.names):
            source = module_file(repo, path, node.module or "", node.level)
            if source is not None:
                return find_class(repo, source, name)
    raise LookupError(f"{path.relative_to(repo)}: class {name} not found")


def class_fields(repo: Path, path: Path, node: ast.ClassDef) -> list[Field]:
    """A dataclass's fields in the order dataclasses (and tyro) give them: the bases' (last base first), then its own; a
    field redefined keeps its place and takes the new default and docstring."""
    fields: dict[str, Field] = {}
    for base in reversed(node.bases):
        if isinstance(base, ast.Name):
            base_path, base_node = find_class(repo, path, base.id)
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):  # `import sac_rlhf` ... `sac_rlhf.Args`
            base_path, base_node = find_class(repo, module_file(repo, path, base.value.id, 0), base.attr)
        else:
            continue
        for field in class_fields(repo, base_path, base_node):
            fields[field.name] = field
    body = node.body
    for index, statement in enumerate(body):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        name = statement.target.id
        annotation = ast.unparse(statement.annotation)
        if isinstance(statement.annotation, ast.Subscript) and ast.unparse(statement.annotation.value) in ("Annotated", "typing.Annotated"):
            annotation = ast.unparse(statement.annotation.slice.elts[0])  # the type; the rest is tyro's (e.g. a built help text)
        if annotation.startswith("ClassVar"):
            continue
        default = None if statement.value is None else ast.unparse(statement.value)
        following = body[index + 1] if index + 1 < len(body) else None
        doc = ""
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
            doc = " ".join(inspect.cleandoc(following.value.value).split())
        if name in fields:
            old = fields[name]
            fields[name] = Field(name, annotation, default, doc or old.doc, old.owner, old.owner_path)
        else:
            fields[name] = Field(name, annotation, default, doc, node.name, path)
    return list(fields.values())


def source_flags(script: str | Path, class_name: str = "Args") -> list[str] | None:
    """The --flags of a script's `class_name` as tyro builds them (--name; --no-name too for a boolean), read from the
    source; None when the source cannot be read that way (the script's own parse then says what is wrong)."""
    path = Path(script).resolve()
    repo = path.parents[1]  # framework/<script>.py
    try:
        owner, node = find_class(repo, path, class_name)
        fields = class_fields(repo, owner, node)
    except (OSError, SyntaxError, LookupError, TypeError):
        return None
    flags = []
    for field in fields:
        flags.append(f"--{field.name.replace('_', '-')}")
        if field.annotation == "bool":
            flags.append(f"--no-{field.name.replace('_', '-')}")
    return flags


def class_constant(repo: Path, path: Path, node: ast.ClassDef, name: str):
    """The literal value of a class attribute `name` (a ClassVar) of a class or, failing that, of its bases; None."""
    for statement in node.body:
        target = statement.target if isinstance(statement, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == name and statement.value is not None:
            return ast.literal_eval(statement.value)
    for base in node.bases:
        try:
            if isinstance(base, ast.Name):
                base_path, base_node = find_class(repo, path, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                base_path, base_node = find_class(repo, module_file(repo, path, base.value.id, 0), base.attr)
            else:
                continue
        except (LookupError, TypeError):
            continue
        value = class_constant(repo, base_path, base_node, name)
        if value is not None:
            return value
    return None


FIRST_GROUP = "start here"
"""the title of the first group --help shows: the flags a newcomer sets (the class attribute `first_flags` of Args)"""


def help_groups(repo: Path, path: Path, class_name: str = "Args") -> list[tuple[str, str, list[Field]]]:
    """The titled groups --help and the flag pages show a script's settings in: (title, description, fields). First
    FIRST_GROUP, the fields Args names in `first_flags` (a string of names); then every other field in the group of the class that declares
    it first (its `help_group`, else the class's name, described by its docstring), groups in the order of their first
    field. One group (all fields, titled by class_name) where Args names no first_flags."""
    owner_path, node = find_class(repo, path, class_name)
    fields = class_fields(repo, owner_path, node)
    first = (class_constant(repo, owner_path, node, "first_flags") or "").split()
    if not first:
        return [(class_name, " ".join((ast.get_docstring(node) or "").split()), fields)]
    by_name = {field.name: field for field in fields}
    groups: dict[str, tuple[str, list[Field]]] = {FIRST_GROUP: ("the flags to set first", [by_name[name] for name in first])}
    for field in fields:
        if field.name in first:
            continue
        _, owner_node = find_class(repo, field.owner_path, field.owner)
        title = class_constant(repo, field.owner_path, owner_node, "help_group") or field.owner
        description = " ".join((ast.get_docstring(owner_node) or "").split())
        groups.setdefault(title, (description, []))[1].append(field)
    return [(title, description, members) for title, (description, members) in groups.items()]
