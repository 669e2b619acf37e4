/* perfsdk.export._spanbuild: region records to OpenTelemetry spans, compiled.
 *
 * SpanBuilder(...)(items, resource, ranks, anchor) is perfsdk.export.spans.build_spans_python
 * without a Python frame per span: each plain record (no error, events or memory readings)
 * becomes the ReadableSpan that region_span() builds, field for field, in the order its
 * __init__ sets them; any other record goes to region_span itself, and an item that is not a
 * record (the application's own span) passes as it is. perfsdk/export/spans.py builds one and
 * trusts it only after a batch of its spans matched region_span's (spans.COMPILED). The spans
 * it builds itself stay out of the garbage collector's lists (see untrack()).
 *
 * A span is the export thread's work: the caller never runs this. On the export thread it is
 * the cost per span that matters, because on a busy training thread that releases the GIL for
 * microseconds at a time (torch ops), the export thread's GIL time is what the caller waits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Field indices of a record tuple (perfsdk/record.py). */
enum { SPEC, TRACE, SPAN, PARENT, T0, T1, THREAD, ERROR, ATTRS, EVENTS, MEMORY, START, END, REGION,
       DEVICE_MS, FIELDS };

typedef struct {
    PyObject_HEAD
    PyObject *span_type;    /* opentelemetry.sdk.trace.ReadableSpan */
    PyObject *context_type; /* opentelemetry.trace.SpanContext (a tuple) */
    PyObject *flags;        /* TraceFlags(SAMPLED) */
    PyObject *state;        /* the default TraceState */
    PyObject *template;     /* ReadableSpan's __dict__ in __init__'s order, constants filled */
    PyObject *specs;        /* perfsdk.record.SPECS */
    PyObject *slow;         /* region_span(record, resource, ranks) */
    PyObject *declared;     /* by spec index: see declared(), or None */
    PyObject *last_trace;   /* the last trace id seen, and whether it is valid */
    int last_valid;
} SpanBuilderObject;

static PyObject *k_name, *k_context, *k_parent, *k_start, *k_end, *k_attributes, *k_resource;
static PyObject *s_name, *s_attributes, *a_host_ms, *a_device_ms, *a_thread_id;
static PyObject *trace_end, *span_end, *zero, *million, *no_args;

static int
spanbuilder_traverse(PyObject *op, visitproc visit, void *arg)
{
    SpanBuilderObject *self = (SpanBuilderObject *)op;
    Py_VISIT(self->span_type);
    Py_VISIT(self->context_type);
    Py_VISIT(self->flags);
    Py_VISIT(self->state);
    Py_VISIT(self->template);
    Py_VISIT(self->specs);
    Py_VISIT(self->slow);
    Py_VISIT(self->declared);
    Py_VISIT(self->last_trace);
    return 0;
}

static int
spanbuilder_clear(PyObject *op)
{
    SpanBuilderObject *self = (SpanBuilderObject *)op;
    Py_CLEAR(self->span_type);
    Py_CLEAR(self->context_type);
    Py_CLEAR(self->flags);
    Py_CLEAR(self->state);
    Py_CLEAR(self->template);
    Py_CLEAR(self->specs);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->declared);
    Py_CLEAR(self->last_trace);
    return 0;
}

static void
spanbuilder_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    spanbuilder_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static int
spanbuilder_init(PyObject *op, PyObject *args, PyObject *kwargs)
{
    SpanBuilderObject *self = (SpanBuilderObject *)op;
    static char *names[] = {"span_type", "context_type", "flags", "state", "template", "specs",
                            "slow", NULL};
    PyObject *span_type, *context_type, *flags, *state, *template, *specs, *slow;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OOO!O!O:SpanBuilder", names,
                                     &PyType_Type, &span_type, &PyType_Type, &context_type,
                                     &flags, &state, &PyDict_Type, &template, &PyList_Type,
                                     &specs, &slow)) {
        return -1;
    }
    if (!PyType_IsSubtype((PyTypeObject *)context_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "SpanBuilder: context_type must be a tuple subclass");
        return -1;
    }
    Py_XSETREF(self->span_type, Py_NewRef(span_type));
    Py_XSETREF(self->context_type, Py_NewRef(context_type));
    Py_XSETREF(self->flags, Py_NewRef(flags));
    Py_XSETREF(self->state, Py_NewRef(state));
    Py_XSETREF(self->template, Py_NewRef(template));
    Py_XSETREF(self->specs, Py_NewRef(specs));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    Py_XSETREF(self->declared, PyList_New(0));
    return self->declared == NULL ? -1 : 0;
}

/* 0 < value < end, as Python compares them; -1 on error. */
static int
within(PyObject *value, PyObject *end)
{
    int above = PyObject_RichCompareBool(value, zero, Py_GT);
    if (above <= 0) {
        return above;
    }
    return PyObject_RichCompareBool(value, end, Py_LT);
}

/* 0 < span_id < 2**64, as Python compares them: one conversion for an int; -1 on error. */
static int
valid_span(PyObject *span_id)
{
    unsigned long long value;
    if (!PyLong_CheckExact(span_id)) {
        return within(span_id, span_end);
    }
    value = PyLong_AsUnsignedLongLong(span_id);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear(); /* negative, or 2**64 and above */
        return 0;
    }
    return value != 0;
}

/* perfsdk.context's span_context(trace_id, span_id): the SpanContext tuple, sampled, local.
 * A batch's records mostly share their trace id (one object): its validity is kept. */
static PyObject *
span_context(SpanBuilderObject *self, PyObject *trace_id, PyObject *span_id)
{
    PyObject *ctx;
    int valid;
    if (trace_id != self->last_trace) {
        valid = within(trace_id, trace_end);
        if (valid < 0) {
            return NULL;
        }
        Py_XSETREF(self->last_trace, Py_NewRef(trace_id));
        self->last_valid = valid;
    }
    valid = self->last_valid;
    if (valid) {
        valid = valid_span(span_id);
        if (valid < 0) {
            return NULL;
        }
    }
    ctx = ((PyTypeObject *)self->context_type)->tp_alloc((PyTypeObject *)self->context_type, 6);
    if (ctx == NULL) {
        return NULL;
    }
    PyTuple_SET_ITEM(ctx, 0, Py_NewRef(trace_id));
    PyTuple_SET_ITEM(ctx, 1, Py_NewRef(span_id));
    PyTuple_SET_ITEM(ctx, 2, Py_NewRef(Py_False));
    PyTuple_SET_ITEM(ctx, 3, Py_NewRef(self->flags));
    PyTuple_SET_ITEM(ctx, 4, Py_NewRef(self->state));
    PyTuple_SET_ITEM(ctx, 5, Py_NewRef(valid ? Py_True : Py_False));
    return ctx;
}

/* The spec's name, a dict of its declared attributes, and that dict followed by the keys a
 * span adds (host_ms and thread.id; host_ms, device_ms and thread.id) in the order it adds
 * them (a spec is immutable: read once). A borrowed reference; NULL with an error set, or
 * without one where the spec's attributes are not a mapping this reads. */
static PyObject *
declared(SpanBuilderObject *self, Py_ssize_t i)
{
    PyObject *spec, *name, *attrs, *proxy, *entry, *host, *device;
    while (PyList_GET_SIZE(self->declared) <= i) {
        if (PyList_Append(self->declared, Py_None) < 0) {
            return NULL;
        }
    }
    entry = PyList_GET_ITEM(self->declared, i);
    if (entry != Py_None) {
        return entry;
    }
    spec = PyList_GET_ITEM(self->specs, i);
    proxy = PyObject_GetAttr(spec, s_attributes);
    if (proxy == NULL) {
        return NULL;
    }
    attrs = NULL;
    if (PyDict_CheckExact(proxy) || Py_IS_TYPE(proxy, &PyDictProxy_Type)) {
        attrs = PyDict_New(); /* what .copy() gives, in the same order */
        if (attrs != NULL && PyDict_Merge(attrs, proxy, 1) < 0) {
            Py_CLEAR(attrs);
        }
    }
    Py_DECREF(proxy);
    if (attrs == NULL) {
        return NULL;
    }
    name = PyObject_GetAttr(spec, s_name);
    host = name == NULL ? NULL : PyDict_Copy(attrs);
    device = host == NULL ? NULL : PyDict_Copy(attrs);
    if (device == NULL || PyDict_SetItem(host, a_host_ms, Py_None) < 0
        || PyDict_SetItem(host, a_thread_id, Py_None) < 0
        || PyDict_SetItem(device, a_host_ms, Py_None) < 0
        || PyDict_SetItem(device, a_device_ms, Py_None) < 0
        || PyDict_SetItem(device, a_thread_id, Py_None) < 0) {
        entry = NULL;
    } else {
        entry = PyTuple_Pack(4, name, attrs, host, device);
    }
    Py_XDECREF(name);
    Py_DECREF(attrs);
    Py_XDECREF(host);
    Py_XDECREF(device);
    if (entry == NULL) {
        return NULL;
    }
    if (PyList_SetItem(self->declared, i, entry) < 0) { /* steals the reference */
        return NULL;
    }
    return entry;
}

/* An exact int within +-2**62 (so that a sum or difference of two cannot overflow) in *out;
 * 0 where it is not one (no error set). */
static int
small_int(PyObject *value, long long *out)
{
    int overflow = 0;
    if (!PyLong_CheckExact(value)) {
        return 0;
    }
    *out = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return *out > -(1LL << 62) && *out < (1LL << 62);
}

/* Python's (t1 - t0) / 1e6: in C where both are such ints (a double from a long long is
 * correctly rounded, as int / float rounds the int). */
static PyObject *
host_ms(PyObject *t0, PyObject *t1)
{
    PyObject *diff, *ms;
    long long a, b;
    if (small_int(t0, &a) && small_int(t1, &b)) {
        return PyFloat_FromDouble((double)(b - a) / 1e6);
    }
    diff = PyNumber_Subtract(t1, t0);
    if (diff == NULL) {
        return NULL;
    }
    ms = PyNumber_TrueDivide(diff, million);
    Py_DECREF(diff);
    return ms;
}

/* Python's anchor + t: in C where both are such ints. */
static PyObject *
add(PyObject *anchor, PyObject *t)
{
    long long a, b;
    if (small_int(anchor, &a) && small_int(t, &b)) {
        return PyLong_FromLongLong(a + b);
    }
    return PyNumber_Add(anchor, t);
}

/* region_attributes(rec, ranks) for a record without memory readings (``entry``: the spec's
 * from declared()); NULL with no error set when the record is not one this builds (the
 * caller takes region_span). */
static PyObject *
attributes(PyObject *entry, PyObject *rec, PyObject *ranks)
{
    PyObject *attrs, *extra, *host, *device;
    extra = PyTuple_GET_ITEM(rec, ATTRS);
    device = PyTuple_GET_ITEM(rec, DEVICE_MS);
    if ((extra == Py_None || (PyDict_CheckExact(extra) && !PyDict_GET_SIZE(extra)))
        && !PyDict_GET_SIZE(ranks)) {
        /* the common case: the spec's attributes, then ours, from a dict of that shape */
        attrs = PyDict_Copy(PyTuple_GET_ITEM(entry, device == Py_None ? 2 : 3));
        if (attrs == NULL) {
            return NULL;
        }
        goto ours;
    }
    attrs = PyDict_Copy(PyTuple_GET_ITEM(entry, 1));
    if (attrs == NULL) {
        return NULL;
    }
    extra = PyTuple_GET_ITEM(rec, ATTRS);
    if (extra != Py_None) {
        if (!PyDict_CheckExact(extra)) {
            Py_DECREF(attrs);
            return NULL;
        }
        if (PyDict_GET_SIZE(extra) && PyDict_Update(attrs, extra) < 0) {
            goto error;
        }
    }
    if (PyDict_GET_SIZE(ranks) && PyDict_Update(attrs, ranks) < 0) {
        goto error;
    }
ours:
    host = host_ms(PyTuple_GET_ITEM(rec, T0), PyTuple_GET_ITEM(rec, T1));
    if (host == NULL) {
        goto error;
    }
    if (PyDict_SetItem(attrs, a_host_ms, host) < 0) {
        Py_DECREF(host);
        goto error;
    }
    Py_DECREF(host);
    if (device != Py_None && PyDict_SetItem(attrs, a_device_ms, device) < 0) {
        goto error;
    }
    if (PyDict_SetItem(attrs, a_thread_id, PyTuple_GET_ITEM(rec, THREAD)) < 0) {
        goto error;
    }
    return attrs;
error:
    Py_DECREF(attrs);
    return NULL;
}

/* Leave a new span's containers out of the garbage collector's lists. Nothing a span holds
 * refers back to it, so it is never part of a reference cycle and the collector has nothing to
 * find in it; reference counting frees it. Tracked, a batch of 2,048 spans alive while it is
 * built survives the young collections its own allocations start, is promoted, and soon sets
 * off a full collection: measured, one of 70 ms (the GIL held all along, 180k objects with
 * torch loaded) every ~50k spans, 1.4 us a span, more than building them. */
static void
untrack(PyObject *op)
{
    if (op != Py_None && PyObject_IS_GC(op) && PyObject_GC_IsTracked(op)) {
        PyObject_GC_UnTrack(op);
    }
}

/* One record's span, or NULL: with an error set on failure, without one where the record
 * is not plain (region_span builds it). */
static PyObject *
build_one(SpanBuilderObject *self, PyObject *rec, PyObject *resource, PyObject *ranks,
          PyObject *anchor)
{
    PyObject *entry, *name, *attrs = NULL, *ctx = NULL, *parent = NULL, *start = NULL;
    PyObject *end = NULL, *fields = NULL, *span = NULL, *index, *parent_id;
    Py_ssize_t i;
    int has_parent;
    if (PyTuple_GET_SIZE(rec) < FIELDS || PyTuple_GET_ITEM(rec, ERROR) != Py_None
        || PyTuple_GET_ITEM(rec, EVENTS) != Py_None || PyTuple_GET_ITEM(rec, MEMORY) != Py_None) {
        return NULL;
    }
    index = PyTuple_GET_ITEM(rec, SPEC);
    if (!PyLong_CheckExact(index)) {
        return NULL;
    }
    i = PyLong_AsSsize_t(index);
    if (i < 0 || i >= PyList_GET_SIZE(self->specs)) {
        PyErr_Clear();
        return NULL;
    }
    entry = declared(self, i);
    if (entry == NULL) {
        return NULL;
    }
    name = PyTuple_GET_ITEM(entry, 0);
    attrs = attributes(entry, rec, ranks);
    if (attrs == NULL) {
        return NULL;
    }
    ctx = span_context(self, PyTuple_GET_ITEM(rec, TRACE), PyTuple_GET_ITEM(rec, SPAN));
    if (ctx == NULL) {
        goto done;
    }
    parent_id = PyTuple_GET_ITEM(rec, PARENT);
    has_parent = PyObject_IsTrue(parent_id);
    if (has_parent < 0) {
        goto done;
    }
    parent = has_parent ? span_context(self, PyTuple_GET_ITEM(rec, TRACE), parent_id)
                        : Py_NewRef(Py_None);
    if (parent == NULL) {
        goto done;
    }
    start = add(anchor, PyTuple_GET_ITEM(rec, T0));
    end = start == NULL ? NULL : add(anchor, PyTuple_GET_ITEM(rec, T1));
    if (end == NULL) {
        goto done;
    }
    fields = PyDict_Copy(self->template);
    if (fields == NULL || PyDict_SetItem(fields, k_name, name) < 0
        || PyDict_SetItem(fields, k_context, ctx) < 0
        || PyDict_SetItem(fields, k_parent, parent) < 0
        || PyDict_SetItem(fields, k_start, start) < 0 || PyDict_SetItem(fields, k_end, end) < 0
        || PyDict_SetItem(fields, k_attributes, attrs) < 0
        || PyDict_SetItem(fields, k_resource, resource) < 0) {
        goto done;
    }
    span = PyBaseObject_Type.tp_new((PyTypeObject *)self->span_type, no_args, NULL);
    if (span != NULL && PyObject_GenericSetDict(span, fields, NULL) < 0) {
        Py_CLEAR(span);
    }
    if (span != NULL) { /* see untrack() */
        untrack(span);
        untrack(fields);
        untrack(attrs);
        untrack(ctx);
        untrack(parent);
    }
done:
    Py_XDECREF(attrs);
    Py_XDECREF(ctx);
    Py_XDECREF(parent);
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(fields);
    return span;
}

static PyObject *
spanbuilder_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    SpanBuilderObject *self = (SpanBuilderObject *)op;
    PyObject *items, *resource, *ranks, *anchor, *seq, *out, *item, *span;
    Py_ssize_t n, i;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "SpanBuilder takes no keyword arguments");
        return NULL;
    }
    if (self->declared == NULL) {
        PyErr_SetString(PyExc_TypeError, "SpanBuilder: not initialized");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOO!O!:SpanBuilder", &items, &resource, &PyDict_Type, &ranks,
                          &PyLong_Type, &anchor)) {
        return NULL;
    }
    seq = PySequence_Fast(items, "SpanBuilder: items must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (i = 0; i < n; i++) {
        item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_CheckExact(item)) {
            span = Py_NewRef(item); /* the application's own span */
        } else {
            span = build_one(self, item, resource, ranks, anchor);
            if (span == NULL) {
                if (PyErr_Occurred()) {
                    goto error;
                }
                span = PyObject_CallFunctionObjArgs(self->slow, item, resource, ranks, NULL);
                if (span == NULL) {
                    goto error;
                }
            }
        }
        PyList_SET_ITEM(out, i, span);
    }
    Py_DECREF(seq);
    return out;
error:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyTypeObject SpanBuilderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk.export._spanbuild.SpanBuilder",
    .tp_basicsize = sizeof(SpanBuilderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SpanBuilder(span_type, context_type, flags, state, template, specs, slow)"
              "(items, resource, ranks, anchor) -> list of spans: "
              "perfsdk.export.spans.build_spans_python, compiled.",
    .tp_new = PyType_GenericNew,
    .tp_init = spanbuilder_init,
    .tp_call = spanbuilder_call,
    .tp_traverse = spanbuilder_traverse,
    .tp_clear = spanbuilder_clear,
    .tp_dealloc = spanbuilder_dealloc,
};

static struct PyModuleDef spanbuild_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "perfsdk.export._spanbuild",
    .m_doc = "Region records to OpenTelemetry spans, compiled (see perfsdk/export/spans.py).",
    .m_size = -1,
};

static int
intern_all(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&k_name, "_name"}, {&k_context, "_context"}, {&k_parent, "_parent"},
        {&k_start, "_start_time"}, {&k_end, "_end_time"}, {&k_attributes, "_attributes"},
        {&k_resource, "_resource"}, {&s_name, "name"}, {&s_attributes, "attributes"},
        {&a_host_ms, "perfsdk.host_ms"}, {&a_device_ms, "perfsdk.device_ms"},
        {&a_thread_id, "thread.id"},
    };
    size_t i;
    for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) {
            return -1;
        }
    }
    trace_end = PyLong_FromString("100000000000000000000000000000000", NULL, 16); /* 2**128 */
    span_end = PyLong_FromString("10000000000000000", NULL, 16);                  /* 2**64 */
    zero = PyLong_FromLong(0);
    million = PyFloat_FromDouble(1e6);
    no_args = PyTuple_New(0);
    return trace_end && span_end && zero && million && no_args ? 0 : -1;
}

PyMODINIT_FUNC
PyInit__spanbuild(void)
{
    PyObject *module;
    if (intern_all() < 0 || PyType_Ready(&SpanBuilderType) < 0) {
        return NULL;
    }
    module = PyModule_Create(&spanbuild_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&SpanBuilderType);
    if (PyModule_AddObject(module, "SpanBuilder", (PyObject *)&SpanBuilderType) < 0) {
        Py_DECREF(&SpanBuilderType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
