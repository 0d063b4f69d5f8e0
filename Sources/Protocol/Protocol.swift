@_exported import struct Wire.JSONValue
@_exported import enum Wire.Nullable

// The chatcore protocol: every request, event and list element of docs/protocol.md, as Swift
// types generated from `Schemas/` (see `Generated/`). Modules above this one speak these
// types and never see JSON; `JSONValue` and `Nullable` are re-exported because the
// generated types use them.
