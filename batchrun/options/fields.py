"""The machinery every options model uses: a field's public name, and validation of a flat
mapping of public names (click's keyword arguments, a TOML table) into a model.

A field is declared once, in a pydantic model, with `option(...)`: its type and constraints,
its default, its description (the --help text) and, where the public name differs from the
attribute, `name=`. Nested models (EngineConfig's cache/scheduler/device) are flattened: every
leaf has one public name, unique across the tree, used alike as `--max-num-seqs` and as
`max_num_seqs = 8` in a job spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, TypeGuard

from pydantic import BaseModel, Field, ValidationError
from pydantic.fields import FieldInfo


def option(default: Any = None, help: str = "", *, name: str | None = None, cli: bool = True,
           flag: str | None = None, metavar: str | None = None, short: str | None = None,
           envvar: str | None = None, section: str | None = None, **constraints: Any) -> Any:
    """A pydantic Field carrying what the CLI and job specs need. `name`: the public name (job
    spec key; --name-with-dashes on the command line unless `flag` spells it otherwise).
    `cli=False`: settable from code (and tests) only. `help`: its first sentence is the one line
    --help shows, the whole text is the reference's. `section`: the --help section (one of
    help_sections.SECTIONS) when it is not its model's SECTION. Constraints (ge, le, ...) go to
    pydantic."""
    extra: dict[str, Any] = {"public": name, "cli": cli, "flag": flag, "metavar": metavar, "short": short,
             "envvar": envvar, "section": section}
    if callable(default):
        return Field(default_factory=default, description=help, json_schema_extra=extra,
                     **constraints)
    return Field(default, description=help, json_schema_extra=extra, **constraints)


@dataclass(frozen=True)
class PublicField:
    name: str  # public: CLI --name-with-dashes, job spec key
    path: tuple[str, ...]  # attribute path inside the model
    info: FieldInfo
    owner_section: str | None = None  # the SECTION of the model that declares the field

    @property
    def extra(self) -> dict[str, Any]:
        return _extra(self.info)

    @property
    def flag(self) -> str:
        return self.extra.get("flag") or "--" + self.name.replace("_", "-")

    @property
    def section(self) -> str | None:
        """Where --help lists it: the field's own section, else its model's."""
        return self.extra.get("section") or self.owner_section


def _extra(info: FieldInfo) -> dict[str, Any]:
    # option() always passes a dict; a plain Field() has none.
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def public_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[PublicField]:
    for attr, info in model.model_fields.items():
        if _is_model(info.annotation):
            yield from public_fields(info.annotation, prefix + (attr,))
            continue
        extra = _extra(info)
        yield PublicField(extra.get("public") or attr, prefix + (attr,), info,
                          getattr(model, "SECTION", None))


class OptionsError(ValueError):
    """An option value the schema rejects; the message names the option and where it came from."""


def _nest(model: type[BaseModel], flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for f in public_fields(model):
        if f.name in flat:
            node = nested
            for part in f.path[:-1]:
                node = node.setdefault(part, {})
            node[f.path[-1]] = flat[f.name]
    return nested


def _describe(model: type[BaseModel], exc: ValidationError, spell) -> str:
    by_path = {f.path: f for f in public_fields(model)}
    problems = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = next((by_path[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in by_path),
                     None)
        where = spell(field.name) if field else ".".join(loc) or "value"
        got = err.get("input")
        shown = f" (got {type(got).__name__} {got!r})" if err["type"] != "missing" and not \
            isinstance(got, dict) and len(repr(got)) < 60 else ""
        problems.append(f"{where}: {err['msg']}{shown}")
    return "; ".join(problems)


def validate(model: type[BaseModel], flat: dict[str, Any], spell=lambda n: n,
             where: str = "") -> Any:
    """The model from public names -> values (what is absent keeps its default). Raises
    OptionsError naming each bad option as `spell(name)` (e.g. `--max-num-seqs`)."""
    known = {f.name for f in public_fields(model)}
    unknown = [k for k in flat if k not in known]
    prefix = f"{where}: " if where else ""
    if unknown:
        raise OptionsError(f"{prefix}unknown key {spell(unknown[0])!s} (known: "
                           f"{', '.join(sorted(known))})")
    try:
        return model.model_validate(_nest(model, flat))
    except ValidationError as exc:
        raise OptionsError(prefix + _describe(model, exc, spell)) from None


def take(model: type[BaseModel], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop this model's public names out of click's keyword arguments, leaving out the ones the
    user did not give (None: the model's default applies)."""
    out = {}
    for f in public_fields(model):
        if f.name in kwargs:
            value = kwargs.pop(f.name)
            if value is not None and value != ():
                out[f.name] = value
    return out


def flat_values(obj: BaseModel) -> dict[str, Any]:
    """Public name -> value of every leaf, e.g. for `batchrun job --dry-run`."""
    out = {}
    for f in public_fields(type(obj)):
        value: Any = obj
        for part in f.path:
            value = getattr(value, part)
        out[f.name] = value
    return out
