/* perfsdk._fastpath: the optional compiled hot path.
 *
 * Each thing here has a pure-Python twin that passes the same tests (perfsdk/markers.py,
 * perfsdk/memory.py and perfsdk/region.py choose; PERFSDK_DISABLE_EXTENSIONS=1 makes them
 * ignore this module):
 *
 * - NvtxCall(domain, message, color, category, payload): a region's NVTX range, built once.
 *   Calling it as call(fn, args, kwargs) pushes the range, calls fn(*args, **kwargs) and pops
 *   the range, also when fn raises. @profiled's wrapper calls it in NVTX-only mode
 *   (PERFSDK_TIMING=0). Built only where the NVTX v3 headers were found (HAVE_NVTX); NVTX is
 *   header-only, so this module is its own NVTX client: nvtxDomainCreateA with the domain's name
 *   gives the tool the same domain the nvtx package's ranges land on (tools key domains by
 *   name), and the category id is the one the nvtx package registered in that domain.
 * - host_times(records, ...): the in-process summary's pass over a chunk of region records
 *   (perfsdk/export/summary.py: _host_times_python).
 * - maxrss(): the process's peak resident set size in bytes (getrusage's ru_maxrss), without
 *   building a struct_rusage object; RssPeak(reuse_ns), memory=True's readings on the host
 *   (perfsdk/memory.py: _RssPeakPython). On Linux it asks for RUSAGE_THREAD: the kernel reports the
 *   address space's high-water mark for it too (the same value as RUSAGE_SELF), without
 *   summing the CPU times of every thread.
 * - InnerGate(spec) and InnerRegion.exit (perfsdk/region.py: inner_gate, RegionSpec.open_inner),
 *   NodeHook(seq, entries) and track() (perfsdk/auto/backward.py: _on_node, track):
 *   instrument_module's per-module entries, the hooking of a call's backward at its forward
 *   and the backward hook, statement for statement the code of their Python twins, without
 *   a Python frame. A gate reads its spec's fixed fields once; the settings'
 *   and the owner Region's __slots__ are read by offset (after an exact type check), and the
 *   modules' globals at every call (bind_inner / bind_backward hand the dicts over), so what a
 *   test swaps there (the host clock) is seen here too (on CPython before 3.12 a read is
 *   cached while the dict's version tag stays the same: see global()). Sampling is decided
 *   here, on the spec's own counter (sampled_out); whatever else is off the fast path (no
 *   Region to ride on, memory, the profiler) goes to RegionSpec.open_inner (or, once sampled
 *   in here, to RegionSpec.enter).
 * - ModuleCall(probe, inner) (perfsdk/auto/module.py: _wrapped_forward): the body of an
 *   instrumented module's forward wrapper; the Python wrapper keeps the torch.compile check
 *   and calls it.
 * - RegionStart(spec) and region_exit (perfsdk/region.py: region_starter, exit_region):
 *   Region._start and Region.exit for an entry on the host, which the steps of perfsdk.auto
 *   use: the first Python work after a training step's torch calls, where every call and
 *   object touched costs microseconds (torch's data fill the caches).
 *
 * On these paths the host clock is read with clock_gettime while region's _perf_ns is
 * time.perf_counter_ns, span and trace ids come from a generator of this module's own while
 * region's _getrandbits is the one bound (see random_id), and a push/pop NVTX range is pushed
 * through its marker's NvtxCall: no Python call for any of them. What a test swaps in (a fake
 * clock, a seeded generator) is called as before.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RUSAGE_THREAD */
#endif
#include <Python.h>
#include <errno.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h> /* getentropy (glibc 2.25+) */
#include <pthread.h>
#ifdef __APPLE__
#include <sys/random.h> /* getentropy */
#endif
#include <structmember.h> /* PyMemberDef, T_OBJECT_EX, READONLY */

#ifdef PERFSDK_NVTX
#include <nvtx3/nvToolsExt.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    nvtxDomainHandle_t domain;
    nvtxEventAttributes_t attributes;
    PyObject *name; /* "domain/message", for repr */
} NvtxCallObject;

static PyObject *
nvtxcall_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    NvtxCallObject *self = (NvtxCallObject *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *fn, *fargs, *fkwargs, *result;
    if (nargs != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "NvtxCall expects (fn, args, kwargs)");
        return NULL;
    }
    fn = args[0];
    fargs = args[1];
    fkwargs = args[2];
    if (!PyTuple_Check(fargs)) {
        PyErr_SetString(PyExc_TypeError, "NvtxCall: args must be a tuple");
        return NULL;
    }
    if (fkwargs == Py_None || (PyDict_Check(fkwargs) && PyDict_GET_SIZE(fkwargs) == 0)) {
        fkwargs = NULL;
    } else if (!PyDict_Check(fkwargs)) {
        PyErr_SetString(PyExc_TypeError, "NvtxCall: kwargs must be a dict or None");
        return NULL;
    }
    nvtxDomainRangePushEx(self->domain, &self->attributes);
    result = PyObject_Call(fn, fargs, fkwargs);
    /* NVTX does not touch Python's error state: an exception from fn passes through as is. */
    nvtxDomainRangePop(self->domain);
    return result;
}

static PyObject *domains; /* domain name -> handle (int): one nvtxDomainCreateA per name */

static nvtxDomainHandle_t
domain_handle(const char *name)
{
    PyObject *cached = PyDict_GetItemString(domains, name); /* borrowed */
    PyObject *value;
    nvtxDomainHandle_t handle;
    if (cached != NULL) {
        return (nvtxDomainHandle_t)PyLong_AsVoidPtr(cached);
    }
    handle = nvtxDomainCreateA(name);
    value = PyLong_FromVoidPtr((void *)handle);
    if (value == NULL || PyDict_SetItemString(domains, name, value) < 0) {
        PyErr_Clear(); /* not cached: the next marker of this domain asks again */
    }
    Py_XDECREF(value);
    return handle;
}

static PyObject *
nvtxcall_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"domain", "message", "color", "category", "payload", NULL};
    const char *domain, *message;
    PyObject *color_obj, *category_obj = NULL, *payload = Py_None;
    unsigned long color, category = 0;
    NvtxCallObject *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ssO!|O!O:NvtxCall", keywords, &domain,
                                     &message, &PyLong_Type, &color_obj, &PyLong_Type,
                                     &category_obj, &payload)) {
        return NULL;
    }
    color = PyLong_AsUnsignedLong(color_obj); /* OverflowError when negative */
    if (color == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (color > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_ValueError, "NvtxCall: color must be an ARGB value");
        return NULL;
    }
    if (category_obj != NULL) {
        category = PyLong_AsUnsignedLong(category_obj);
        if (category == (unsigned long)-1 && PyErr_Occurred()) {
            return NULL;
        }
        if (category > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_ValueError, "NvtxCall: category must be a uint32 id");
            return NULL;
        }
    }
    if (payload != Py_None && !PyLong_Check(payload)) {
        PyErr_SetString(PyExc_TypeError, "NvtxCall: payload must be an int or None");
        return NULL;
    }
    self = (NvtxCallObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = nvtxcall_vectorcall;
    memset(&self->attributes, 0, sizeof self->attributes);
    self->attributes.version = NVTX_VERSION;
    self->attributes.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    self->attributes.colorType = NVTX_COLOR_ARGB;
    self->attributes.color = (uint32_t)color;
    self->attributes.category = (uint32_t)category;
    if (payload != Py_None) {
        long long value = PyLong_AsLongLong(payload);
        if (value == -1 && PyErr_Occurred()) {
            Py_DECREF(self);
            return NULL;
        }
        self->attributes.payloadType = NVTX_PAYLOAD_TYPE_INT64;
        self->attributes.payload.llValue = value;
    }
    self->name = PyUnicode_FromFormat("%s/%s", domain, message);
    if (self->name == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->domain = domain_handle(domain);
    self->attributes.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    self->attributes.message.registered = nvtxDomainRegisterStringA(self->domain, message);
    if (self->attributes.message.registered == NULL) { /* no tool, or it registers none */
        self->attributes.messageType = NVTX_MESSAGE_TYPE_ASCII;
        self->attributes.message.ascii = PyUnicode_AsUTF8(self->name) + strlen(domain) + 1;
    }
    return (PyObject *)self;
}

static void
nvtxcall_dealloc(PyObject *op)
{
    NvtxCallObject *self = (NvtxCallObject *)op;
    Py_XDECREF(self->name);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
nvtxcall_repr(PyObject *op)
{
    return PyUnicode_FromFormat("<perfsdk._fastpath.NvtxCall %R>", ((NvtxCallObject *)op)->name);
}

/* pop_range(): the range's pop, for the pure-Python InnerRegion.exit given an entry whose range
 * the compiled gate pushed (it stores the NvtxCall where the nvtx package's domain would be). */
static PyObject *
nvtxcall_pop_range(PyObject *op, PyObject *unused)
{
    nvtxDomainRangePop(((NvtxCallObject *)op)->domain);
    Py_RETURN_NONE;
}

static PyMethodDef nvtxcall_methods[] = {
    {"pop_range", nvtxcall_pop_range, METH_NOARGS, "pop_range(): pop the range (nvtx's API)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NvtxCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.NvtxCall",
    .tp_doc = "NvtxCall(domain, message, color, category=0, payload=None): call(fn, args, "
              "kwargs) runs fn(*args, **kwargs) inside the NVTX range.",
    .tp_basicsize = sizeof(NvtxCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(NvtxCallObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = nvtxcall_new,
    .tp_dealloc = nvtxcall_dealloc,
    .tp_repr = nvtxcall_repr,
    .tp_methods = nvtxcall_methods,
};
#endif /* PERFSDK_NVTX */


/* ---- inner regions and the backward node hook -------------------------------------------- */

/* Slots (__slots__ members) read and written by their offset, as the interpreter's own
 * specialized attribute loads do: only on objects whose type is exactly the one the offset was
 * taken from (checked before each use). A slot that is unset (NULL) sends the entry to the
 * Python twin, which raises the same AttributeError. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t timed, t1, start_event, thread_id, gen, inner_id, span_id, trace_id;
} RegionSlots;
typedef struct {
    PyTypeObject *type;
    Py_ssize_t enabled, sample_every, timing, nvtx, memory;
} StateSlots;

static PyObject *region_globals;   /* perfsdk.region's module dict (bind_inner) */
static PyObject *backward_globals; /* perfsdk.auto.backward's module dict (bind_backward) */
static PyTypeObject *inner_type;   /* perfsdk.region.InnerRegion */
static PyTypeObject *context_type; /* OpenTelemetry's Context (a dict), or NULL */
static PyObject *null_region;      /* perfsdk.region.NULL_REGION */
static RegionSlots region_slots;
static StateSlots state_slots;
static PyTypeObject *fork_type;
static Py_ssize_t fork_generation;
static PyObject *int_64, *int_done;
static PyObject *perf_counter_ns; /* time.perf_counter_ns (bind_inner) */
static PyObject *ids_getrandbits; /* perfsdk.region._getrandbits as bound (bind_inner) */
static PyObject *inner_exit_descr; /* the compiled InnerRegion.exit (bind_inner) */

/* The host clock a region reads (new reference): region's _perf_ns, read without calling it
 * while it is time.perf_counter_ns (CLOCK_MONOTONIC on Linux: the same reading); what a test
 * swaps in (perfsdk.testing's clocks) is called. */
static PyObject *
clock_read(PyObject *fn)
{
#ifdef CLOCK_MONOTONIC
    struct timespec ts;
    if (fn == perf_counter_ns && clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
        return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    }
#endif
    return PyObject_CallNoArgs(fn);
}

/* Span and trace ids. While region's _getrandbits is the one bound at bind_inner (a test may
 * swap it), ids come from a generator of this module's own: splitmix64 over a counter seeded
 * from the OS (getentropy) at import and again in every forked child (pthread_atfork), so a
 * program's random.seed() never repeats them, nor does a DataLoader worker repeat its
 * parent's; distinct within a process (a bijection of the counter) and without the Mersenne
 * Twister's 2.5 KB of state to touch at every region. The GIL guards the counter. */
static uint64_t id_counter;

static void
ids_seed(void)
{
    uint64_t seed = 0;
    struct timespec ts;
    if (getentropy(&seed, sizeof seed) != 0) {
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16)
               ^ (uint64_t)(uintptr_t)&seed;
    }
    id_counter = seed;
}

static uint64_t
ids_next(void)
{
    uint64_t z = (id_counter += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A new id of `bits` (64 or 128) bits, never 0 (new reference): fn(bits) or 1 where fn is
 * neither NULL nor the bound generator. */
static PyObject *
random_id(PyObject *fn, int bits)
{
    PyObject *value;
    int truth;
    if (fn == NULL || fn == ids_getrandbits) {
        uint64_t low = ids_next(), high = bits > 64 ? ids_next() : 0;
        unsigned char bytes[16];
        int i;
        if (bits <= 64) {
            return PyLong_FromUnsignedLongLong(low ? low : 1);
        }
        if (!low && !high) {
            low = 1;
        }
        for (i = 0; i < 8; i++) {
            bytes[i] = (unsigned char)(low >> (8 * i));
            bytes[8 + i] = (unsigned char)(high >> (8 * i));
        }
        return _PyLong_FromByteArray(bytes, 16, 1, 0);
    }
    value = bits == 64 ? PyObject_CallOneArg(fn, int_64) : PyObject_CallFunction(fn, "i", bits);
    if (value == NULL || (truth = PyObject_IsTrue(value)) > 0) {
        return value;
    }
    Py_DECREF(value);
    return truth < 0 ? NULL : PyLong_FromLong(1);
}

#define INTERNED(X) X(_state) X(_cur_get) X(_SPAN_KEY) X(get) X(_FORK) X(_torch_profiler) \
    X(_is_profiler_enabled) X(_getrandbits) X(_perf_ns) X(open_inner) X(open) X(pop_range) \
    X(end_range) X(start_range) X(push_range) X(_queue) X(PIPELINE) X(max_pending) X(spill) \
    X(_enqueue) X(_tls) X(stack) \
    X(task) X(_task_id) X(_queue_callback) X(_end_of_pass) X(_partial) X(_warn) X(exit) \
    X(error) X(t1) X(every) X(memory) X(nvtx) X(domain) X(attributes) X(asynchronous) X(index) \
    X(nodes) X(grad_fn) X(_sequence_nr) X(_backward_hooks) X(_register_hook_dict) \
    X(register_prehook) X(_Tensor) X(_Hooks) X(_HOOK_KEY) X(_register) X(_make_hook) \
    X(track_python) X(forward) X(enabled) X(_no_backward) X(_forward_done) X(_grad_enabled) \
    X(_input_nodes) X(_first_node) X(started) X(_is_initialized) X(_initialized) \
    X(_noted) X(_start_python) X(_Context) X(_detach) X(_run_id) X(_ENV_KEYS) X(_RUN_ID_KEY) \
    X(_STEP_START) X(_any_autocast) X(autocast_dtype) X(_step_python) X(_end) X(exit_region) \
    X(_memory) X(TRACKER) X(rss) X(baseline) X(host_exit) X(calls) X(enter)
#define DECLARE(name) static PyObject *s_##name;
INTERNED(DECLARE)
#undef DECLARE

static int
intern_names(void)
{
#define MAKE(name) if ((s_##name = PyUnicode_InternFromString(#name)) == NULL) return -1;
    INTERNED(MAKE)
#undef MAKE
    return 0;
}

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

/* A clock reading's int as a C integer: PyLong_AsLong where a long has 64 bits (a loop over the
 * int's digits; PyLong_AsLongLong converts through a byte array, a longer and colder path). */
#if LONG_MAX >= 0x7FFFFFFFFFFFFFFFL
#define AS_NS(value) ((long long)PyLong_AsLong(value))
#else
#define AS_NS(value) PyLong_AsLongLong(value)
#endif

/* list.pop() of a non-empty exact list: its last item (the list's reference, handed over). As
 * list.pop does, less its resize: the list keeps its storage (size <= allocated, as after any
 * pop), and no slice code runs (PyList_SetSlice's is long: cold in place, its instruction cache
 * misses cost more than the rest of a phase's exit). */
static PyObject *
list_pop_last(PyObject *list)
{
    Py_ssize_t last = PyList_GET_SIZE(list) - 1;
    PyObject *item = PyList_GET_ITEM(list, last);
    PyList_SET_ITEM(list, last, NULL);
    Py_SET_SIZE(list, last);
    return item;
}

/* The offset of the __slots__ member `name` of `type`, or -1 with an exception set. */
static Py_ssize_t
slot_offset(PyTypeObject *type, const char *name)
{
    PyObject *descr = PyDict_GetItemString(type->tp_dict, name); /* borrowed */
    PyMemberDef *member;
    if (descr == NULL || !PyObject_TypeCheck(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "perfsdk._fastpath: %s.%s is not a __slots__ member",
                     type->tp_name, name);
        return -1;
    }
    member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        PyErr_Format(PyExc_TypeError, "perfsdk._fastpath: %s.%s is not a plain slot",
                     type->tp_name, name);
        return -1;
    }
    return member->offset;
}

/* A module global (borrowed), or NULL with an exception set: the dict's item. */
static PyObject *
global_lookup(PyObject *globals, PyObject *name)
{
    PyObject *value = PyDict_GetItemWithError(globals, name);
    if (value == NULL && !PyErr_Occurred()) {
        PyErr_Format(PyExc_NameError, "perfsdk._fastpath: global %R is gone", name);
    }
    return value;
}

#if PY_VERSION_HEX < 0x030C0000 && defined(__GNUC__)
/* global(globals, name): a module global (borrowed), or NULL with an exception set, cached at
 * each place that reads one (a static per expansion of the macro) while the dict's version tag
 * is the one it had then. CPython gives every change of any dict a new tag (3.11: a global
 * counter), so an unchanged tag means an unchanged dict, whose value is still there. A test
 * swapping a module's global changes the tag: it is read again. One cache per place, not a
 * shared table: the places one call passes through sit side by side in memory, so a step's
 * forty reads touch a few cache lines, where a hashed table spread them over forty (in place,
 * after a training step's torch calls, each line missed costs tens of nanoseconds). 3.12
 * deprecated the tag: no cache there, nor without GNU C's statement expressions. */
typedef struct {
    PyObject *dict;
    PyObject *value;
    uint64_t version;
} GlobalSite;

__attribute__((noinline)) static PyObject *
global_at(GlobalSite *site, PyObject *globals, PyObject *name)
{
    uint64_t version = ((PyDictObject *)globals)->ma_version_tag;
    PyObject *value;
    if (site->dict == globals && site->version == version) {
        return site->value;
    }
    if ((value = global_lookup(globals, name)) != NULL) {
        site->dict = globals;
        site->value = value;
        site->version = version;
    }
    return value;
}
#define global(globals, name) \
    __extension__({ static GlobalSite site_; global_at(&site_, (globals), (name)); })
#else
#define global(globals, name) global_lookup((globals), (name))
#endif

/* The marker's compiled range (new reference): its `call` when that is an NvtxCall (a tool
 * listens and the module was built with NVTX), else NULL, without an exception. */
static PyObject *
marker_call(PyObject *nvtx)
{
#ifdef PERFSDK_NVTX
    PyObject *call = PyObject_GetAttrString(nvtx, "call");
    if (call == NULL) {
        PyErr_Clear();
    } else if (Py_TYPE(call) != &NvtxCallType) {
        Py_CLEAR(call);
    }
    return call;
#else
    (void)nvtx;
    return NULL;
#endif
}

/* What a gate reads once from its spec: the memory setting, the sampling counter and the
 * region's NVTX range. */
typedef struct {
    PyObject *memory;     /* spec.memory: None (the configured setting) or a bool */
    PyObject *calls;      /* spec.calls, the sampling counter: an iterator, or NULL */
    PyObject *push;       /* spec.nvtx.domain.push_range / start_range, or None */
    PyObject *attributes; /* spec.nvtx.attributes */
    PyObject *domain;     /* spec.nvtx.domain, or None */
    PyObject *nvtx_call;  /* spec.nvtx.call, an NvtxCall pushed and popped here, or NULL */
    int asynchronous;
} SpecRange;

/* Read `range` from `spec`: 0, or -1 with an exception set (what was read is kept, for the
 * owner's dealloc to release). */
static int
spec_range_read(SpecRange *range, PyObject *spec)
{
    PyObject *nvtx = NULL, *value = NULL;
    int truth, result = -1;
    if ((range->memory = PyObject_GetAttr(spec, s_memory)) == NULL
        || (range->calls = PyObject_GetAttr(spec, s_calls)) == NULL
        || (nvtx = PyObject_GetAttr(spec, s_nvtx)) == NULL
        || (range->domain = PyObject_GetAttr(nvtx, s_domain)) == NULL
        || (range->attributes = PyObject_GetAttr(nvtx, s_attributes)) == NULL
        || (value = PyObject_GetAttr(spec, s_asynchronous)) == NULL
        || (truth = PyObject_IsTrue(value)) < 0) {
        goto done;
    }
    range->asynchronous = truth;
    if (!PyIter_Check(range->calls)) { /* not a counter: the Python gate samples */
        Py_CLEAR(range->calls);
    }
    if (range->domain == Py_None) {
        range->push = Py_NewRef(Py_None);
    } else if ((range->push = PyObject_GetAttr(range->domain, truth ? s_start_range
                                                                    : s_push_range)) == NULL) {
        goto done;
    }
    if (!truth) { /* a push/pop range: the marker's NvtxCall pushes it without a call */
        range->nvtx_call = marker_call(nvtx);
    }
    result = 0;
done:
    Py_XDECREF(nvtx);
    Py_XDECREF(value);
    return result;
}

static int
spec_range_traverse(SpecRange *range, visitproc visit, void *arg)
{
    Py_VISIT(range->memory);
    Py_VISIT(range->calls);
    Py_VISIT(range->push);
    Py_VISIT(range->attributes);
    Py_VISIT(range->domain);
    Py_VISIT(range->nvtx_call);
    return 0;
}

static void
spec_range_clear(SpecRange *range)
{
    Py_CLEAR(range->memory);
    Py_CLEAR(range->calls);
    Py_CLEAR(range->push);
    Py_CLEAR(range->attributes);
    Py_CLEAR(range->domain);
    Py_CLEAR(range->nvtx_call);
}

/* The sampling decision of a spec's gate, for a rate n (an int != 1): `next(spec.calls) % n`
 * is 1 (sampled out: NULL_REGION), 0 (sampled in) or -1 (an error set). The Python gates'
 * expression, on the same counter. */
static int
sampled_out(SpecRange *range, PyObject *n)
{
    PyObject *count, *rest;
    int truth;
    if ((count = PyIter_Next(range->calls)) == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "perfsdk: a spec's call counter ran out");
        }
        return -1;
    }
    rest = PyNumber_Remainder(count, n);
    Py_DECREF(count);
    if (rest == NULL) {
        return -1;
    }
    truth = PyObject_IsTrue(rest);
    Py_DECREF(rest);
    return truth;
}

/* Push (or start) the range, _state.nvtx having been found on: *dom gets what the exit closes
 * it with (the NvtxCall, or the nvtx package's domain), *rid a start/end range's id (new
 * reference; else left as it is). 0, or -1 with an exception set. */
static int
spec_range_push(SpecRange *range, PyObject **dom, PyObject **rid)
{
    PyObject *pushed;
#ifdef PERFSDK_NVTX
    if (range->nvtx_call != NULL) { /* the same range, without a call */
        NvtxCallObject *call = (NvtxCallObject *)range->nvtx_call;
        nvtxDomainRangePushEx(call->domain, &call->attributes);
        *dom = range->nvtx_call;
        return 0;
    }
#endif
    if ((pushed = PyObject_CallOneArg(range->push, range->attributes)) == NULL) {
        return -1;
    }
    *dom = range->domain;
    if (range->asynchronous) {
        *rid = pushed;
    } else {
        Py_DECREF(pushed);
    }
    return 0;
}

/* InnerGate(spec): gate() is spec.open_inner() (RegionSpec.open_inner, compiled), with the
 * spec's fixed fields read once. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *spec;
    PyObject *index;
    PyObject *every;      /* spec.every: None (the configured rate) or an int */
    SpecRange range;
} InnerGateObject;

/* 1: the entry may ride on `owner`; 0: not (a Region of its own); -1: error.
 * RegionSpec.open_inner's condition, with the owner already found to be a Region. */
static int
may_ride(InnerGateObject *gate, PyObject *state, PyObject *owner)
{
    PyObject *value, *fork, *profiling;
    int truth;
    unsigned long ident;
    /* owner._timed and not owner.t1 and owner.start_event is None */
    if ((value = SLOT(owner, region_slots.timed)) == NULL
        || (truth = PyObject_IsTrue(value)) <= 0) {
        return value == NULL ? 0 : truth;
    }
    if ((value = SLOT(owner, region_slots.t1)) == NULL || (truth = PyObject_IsTrue(value)) != 0) {
        return value == NULL ? 0 : (truth < 0 ? -1 : 0);
    }
    if (SLOT(owner, region_slots.start_event) != Py_None) {
        return 0;
    }
    /* owner.thread_id == _get_ident() */
    if ((value = SLOT(owner, region_slots.thread_id)) == NULL || !PyLong_CheckExact(value)) {
        return 0;
    }
    ident = PyLong_AsUnsignedLong(value);
    if (ident == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (ident != PyThread_get_thread_ident()) {
        return 0;
    }
    /* owner._gen == _FORK.generation */
    if ((fork = global(region_globals, s__FORK)) == NULL) {
        return -1;
    }
    if (Py_TYPE(fork) != fork_type || (value = SLOT(owner, region_slots.gen)) == NULL
        || SLOT(fork, fork_generation) == NULL) {
        return 0;
    }
    if ((truth = PyObject_RichCompareBool(value, SLOT(fork, fork_generation), Py_EQ)) <= 0) {
        return truth;
    }
    /* not (memory or (memory is None and _state.memory)) */
    value = gate->range.memory == Py_None ? SLOT(state, state_slots.memory) : gate->range.memory;
    if (value == NULL || (truth = PyObject_IsTrue(value)) != 0) {
        return value == NULL ? 0 : (truth < 0 ? -1 : 0);
    }
    /* not _torch_profiler._is_profiler_enabled */
    if ((profiling = global(region_globals, s__torch_profiler)) == NULL) {
        return -1;
    }
    if (!PyModule_CheckExact(profiling)) {
        PyErr_SetString(PyExc_TypeError, "perfsdk: _torch_profiler is not a module");
        return -1;
    }
    if ((profiling = global(PyModule_GetDict(profiling), s__is_profiler_enabled)) == NULL
        || (truth = PyObject_IsTrue(profiling)) < 0) {
        return -1;
    }
    return !truth;
}

static PyObject *current_var;      /* perfsdk.context.CURRENT, or NULL (bind_region) */
static PyCFunction contextvar_get; /* ContextVar.get's C function (bind_region) */

/* The current span (new reference): _cur_get(), and its _SPAN_KEY entry under OpenTelemetry.
 * NULL with no exception when there is no context variable to read (_cur_get is None). */
static PyObject *
current_span(void)
{
    PyObject *cur_get, *key, *context, *span;
    if ((cur_get = global(region_globals, s__cur_get)) == NULL || cur_get == Py_None
        || (key = global(region_globals, s__SPAN_KEY)) == NULL) {
        return NULL;
    }
    /* _cur_get is CURRENT.get: the variable read directly (a value, else its default), less the
     * call machinery; with neither, get() is called, and raises as it does */
    context = NULL;
    if (current_var != NULL && PyCFunction_Check(cur_get)
        && PyCFunction_GET_SELF(cur_get) == current_var
        && PyCFunction_GET_FUNCTION(cur_get) == contextvar_get
        && PyContextVar_Get(current_var, NULL, &context) < 0) {
        return NULL;
    }
    if (context == NULL && (context = PyObject_CallNoArgs(cur_get)) == NULL) {
        return NULL;
    }
    if (key == Py_None) {
        return context;
    }
    if (PyDict_CheckExact(context) || Py_TYPE(context) == context_type) { /* no get() of its own */
        span = PyDict_GetItemWithError(context, key);
        if (span == NULL && !PyErr_Occurred()) {
            span = Py_None;
        }
        Py_XINCREF(span);
    } else {
        span = PyObject_CallMethodOneArg(context, s_get, key);
    }
    Py_DECREF(context);
    return span;
}

static PyObject *
gate_python(InnerGateObject *gate)
{
    return PyObject_CallMethodNoArgs(gate->spec, s_open_inner);
}

/* The Python code from where the compiled gate stops: spec.open_inner(); or, the entry
 * sampled in here, what open_inner does past sampling when the entry does not ride on its
 * owner: spec.enter(). */
static PyObject *
gate_python_from(InnerGateObject *gate, int sampled)
{
    return sampled ? PyObject_CallMethodNoArgs(gate->spec, s_enter) : gate_python(gate);
}

static PyObject *
gate_open(InnerGateObject *gate)
{
    PyObject *state, *every, *owner, *rid = Py_None, *span_id = NULL, *t0 = NULL, *fn, *result;
    PyObject *outer, *parent, *value, *dom = Py_None;
    int truth, overflow, sampled = 0;
    long n;
    if ((state = global(region_globals, s__state)) == NULL) {
        return NULL;
    }
    if (Py_TYPE(state) != state_slots.type || (value = SLOT(state, state_slots.enabled)) == NULL) {
        return gate_python(gate);
    }
    if ((truth = PyObject_IsTrue(value)) <= 0) {
        return truth < 0 ? NULL : Py_NewRef(null_region);
    }
    /* n = spec.every or _state.sample_every; n != 1: next(spec.calls) % n, as in Python */
    every = gate->every != Py_None ? gate->every : SLOT(state, state_slots.sample_every);
    if (every == NULL || !PyLong_CheckExact(every)) {
        return gate_python(gate);
    }
    if ((n = PyLong_AsLongAndOverflow(every, &overflow)) != 1) {
        if (n == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (gate->range.calls == NULL) {
            return gate_python(gate);
        }
        if ((truth = sampled_out(&gate->range, every)) != 0) {
            return truth < 0 ? NULL : Py_NewRef(null_region);
        }
        sampled = 1; /* sampled in: from here, the Python code is open_inner's rest */
    }
    if ((value = SLOT(state, state_slots.timing)) == NULL
        || (truth = PyObject_IsTrue(value)) <= 0) {
        return value == NULL || truth == 0 ? gate_python_from(gate, sampled) : NULL;
    }
    if ((owner = current_span()) == NULL) {
        return PyErr_Occurred() ? NULL : gate_python_from(gate, sampled);
    }
    if (Py_TYPE(owner) != region_slots.type || (truth = may_ride(gate, state, owner)) == 0) {
        Py_DECREF(owner);
        return gate_python_from(gate, sampled);
    }
    if (truth < 0) {
        Py_DECREF(owner);
        return NULL;
    }
    /* the NVTX range: push (or start) when _state.nvtx and the spec has a domain */
    if (gate->range.push != Py_None) {
        if ((value = SLOT(state, state_slots.nvtx)) == NULL
            || (truth = PyObject_IsTrue(value)) < 0) {
            Py_DECREF(owner);
            return value == NULL ? gate_python_from(gate, sampled) : NULL;
        }
        if (truth && spec_range_push(&gate->range, &dom, &rid) < 0) {
            Py_DECREF(owner);
            return NULL;
        }
    }
    /* outer = owner.inner_id; owner.inner_id = span_id = _getrandbits(64) or 1 */
    result = NULL;
    if ((outer = SLOT(owner, region_slots.inner_id)) == NULL
        || (parent = SLOT(owner, region_slots.span_id)) == NULL) {
        PyErr_SetString(PyExc_AttributeError, "perfsdk: the owner region is not entered");
        goto done;
    }
    if ((fn = global(region_globals, s__getrandbits)) == NULL
        || (span_id = random_id(fn, 64)) == NULL) {
        goto done;
    }
    /* the slot's reference to outer (borrowed until here) is ours from now on */
    SLOT(owner, region_slots.inner_id) = Py_NewRef(span_id);
    if ((truth = PyObject_IsTrue(outer)) < 0) {
        Py_DECREF(outer);
        goto done;
    }
    if (truth) {
        parent = outer;  /* else the owner's span_id, borrowed: the owner holds it */
    }
    if ((fn = global(region_globals, s__perf_ns)) == NULL
        || (t0 = clock_read(fn)) == NULL
        || (result = inner_type->tp_alloc(inner_type, 8)) == NULL) {
        Py_DECREF(outer);
        goto done;
    }
    PyTuple_SET_ITEM(result, 0, Py_NewRef(owner));
    PyTuple_SET_ITEM(result, 1, Py_NewRef(gate->index));
    PyTuple_SET_ITEM(result, 2, Py_NewRef(span_id));
    PyTuple_SET_ITEM(result, 3, Py_NewRef(parent));
    PyTuple_SET_ITEM(result, 4, outer); /* steals */
    PyTuple_SET_ITEM(result, 5, Py_NewRef(dom));
    PyTuple_SET_ITEM(result, 6, Py_NewRef(rid));
    PyTuple_SET_ITEM(result, 7, Py_NewRef(t0));
done:
    Py_DECREF(owner);
    if (rid != Py_None) {
        Py_DECREF(rid);
    }
    Py_XDECREF(span_id);
    Py_XDECREF(t0);
    return result;
}

static PyObject *
gate_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "InnerGate takes no arguments");
        return NULL;
    }
    return gate_open((InnerGateObject *)op);
}

static PyObject *
gate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *spec;
    InnerGateObject *self;
    if (region_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "perfsdk._fastpath: bind_inner() was not called");
        return NULL;
    }
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)
        || !PyArg_ParseTuple(args, "O:InnerGate", &spec)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "InnerGate(spec) takes no keyword arguments");
        }
        return NULL;
    }
    if ((self = (InnerGateObject *)type->tp_alloc(type, 0)) == NULL) {
        return NULL;
    }
    self->vectorcall = gate_vectorcall;
    self->spec = Py_NewRef(spec);
    if ((self->index = PyObject_GetAttr(spec, s_index)) == NULL
        || (self->every = PyObject_GetAttr(spec, s_every)) == NULL
        || spec_range_read(&self->range, spec) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    if (self->every != Py_None && !PyLong_CheckExact(self->every)) {
        PyErr_SetString(PyExc_TypeError, "InnerGate: spec.every must be an int or None");
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
gate_traverse(PyObject *op, visitproc visit, void *arg)
{
    InnerGateObject *self = (InnerGateObject *)op;
    Py_VISIT(self->spec);
    Py_VISIT(self->index);
    Py_VISIT(self->every);
    return spec_range_traverse(&self->range, visit, arg);
}

static int
gate_clear(PyObject *op)
{
    InnerGateObject *self = (InnerGateObject *)op;
    Py_CLEAR(self->spec);
    Py_CLEAR(self->index);
    Py_CLEAR(self->every);
    spec_range_clear(&self->range);
    return 0;
}

static void
gate_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    gate_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
gate_repr(PyObject *op)
{
    return PyUnicode_FromFormat("<perfsdk._fastpath.InnerGate %R>", ((InnerGateObject *)op)->spec);
}

static PyTypeObject InnerGateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.InnerGate",
    .tp_doc = "InnerGate(spec): gate() is spec.open_inner(), compiled (after bind_inner).",
    .tp_basicsize = sizeof(InnerGateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(InnerGateObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = gate_new,
    .tp_dealloc = gate_dealloc,
    .tp_traverse = gate_traverse,
    .tp_clear = gate_clear,
    .tp_repr = gate_repr,
};

/* The Pipeline class's `started` and `max_pending` __slots__ (bind_inner): read at their offsets
 * on every region, where a generic lookup's cache misses (the type's method cache, the
 * instance dict, its keys) cost more than its instructions. */
static PyTypeObject *pipeline_type;
static struct {
    Py_ssize_t started, max_pending;
} pipeline_slots;

/* pipeline.<name> (new reference), read at its slot's offset when pipeline is a Pipeline whose
 * slot is set; else looked up. NULL with an exception set. */
static PyObject *
pipeline_attr(PyObject *pipeline, Py_ssize_t offset, PyObject *name)
{
    PyObject *value;
    if (Py_TYPE(pipeline) == pipeline_type && (value = SLOT(pipeline, offset)) != NULL) {
        return Py_NewRef(value);
    }
    return PyObject_GetAttr(pipeline, name);
}

/* if len(_queue) < PIPELINE.max_pending: _enqueue(record) else: PIPELINE.spill(record)
 * (PIPELINE.submit, as the Python exits write it out). 0, or -1 with an exception set. */
static int
enqueue_record(PyObject *record)
{
    PyObject *queue, *pipeline, *limit, *fn, *res;
    Py_ssize_t length, most;
    if ((queue = global(region_globals, s__queue)) == NULL
        || (pipeline = global(region_globals, s_PIPELINE)) == NULL
        || (limit = pipeline_attr(pipeline, pipeline_slots.max_pending, s_max_pending)) == NULL) {
        return -1;
    }
    most = PyLong_AsSsize_t(limit);
    Py_DECREF(limit);
    if ((most == -1 && PyErr_Occurred()) || (length = PyObject_Length(queue)) < 0) {
        return -1;
    }
    if (length < most) {
        if ((fn = global(region_globals, s__enqueue)) == NULL) {
            return -1;
        }
        /* _enqueue is _queue.append, a builtin method taking one argument: its C function is
         * called as the call machinery would call it, less that machinery's code */
        res = PyCFunction_Check(fn) && PyCFunction_GET_FLAGS(fn) == METH_O
                      && PyCFunction_GET_SELF(fn) == queue
                  ? PyCFunction_GET_FUNCTION(fn)(queue, record)
                  : PyObject_CallOneArg(fn, record);
    } else {
        res = PyObject_CallMethodOneArg(pipeline, s_spill, record);
    }
    if (res == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
}

/* InnerRegion.exit(error=None, t1=0), compiled (a method of the Python class). */
static PyObject *
inner_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *error = Py_None, *t1 = NULL, *owner, *dom, *rid, *fn, *record;
    PyObject *trace_id, *thread_id, *res;
    Py_ssize_t i, nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int truth, exact;
    if (nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "exit() takes at most 2 arguments");
        return NULL;
    }
    if (nargs > 0) {
        error = args[0];
    }
    if (nargs > 1) {
        t1 = args[1];
    }
    for (i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        int is_error = PyUnicode_Compare(name, s_error) == 0;
        if ((!is_error && PyUnicode_Compare(name, s_t1) != 0) || (is_error && nargs > 0)
            || (!is_error && nargs > 1)) {
            PyErr_Format(PyExc_TypeError, "exit() got an unexpected keyword argument %R", name);
            return NULL;
        }
        if (is_error) {
            error = args[nargs + i];
        } else {
            t1 = args[nargs + i];
        }
    }
    if (PyTuple_GET_SIZE(self) != 8) {
        PyErr_SetString(PyExc_TypeError, "InnerRegion.exit: not an inner entry");
        return NULL;
    }
    /* if not t1: t1 = _perf_ns() */
    if (t1 != NULL && (truth = PyObject_IsTrue(t1)) != 0) {
        if (truth < 0) {
            return NULL;
        }
        Py_INCREF(t1);
    } else if ((fn = global(region_globals, s__perf_ns)) == NULL
               || (t1 = clock_read(fn)) == NULL) {
        return NULL;
    }
    owner = PyTuple_GET_ITEM(self, 0);
    dom = PyTuple_GET_ITEM(self, 5);
    rid = PyTuple_GET_ITEM(self, 6);
    exact = Py_TYPE(owner) == region_slots.type;
    /* owner.inner_id = outer */
    if (exact) {
        Py_XSETREF(SLOT(owner, region_slots.inner_id), Py_NewRef(PyTuple_GET_ITEM(self, 4)));
    } else if (PyObject_SetAttrString(owner, "inner_id", PyTuple_GET_ITEM(self, 4)) < 0) {
        Py_DECREF(t1);
        return NULL;
    }
#ifdef PERFSDK_NVTX
    if (Py_TYPE(dom) == &NvtxCallType && rid == Py_None) { /* pushed by the compiled gate */
        nvtxDomainRangePop(((NvtxCallObject *)dom)->domain);
        dom = Py_None;
    }
#endif
    if (dom != Py_None) {
        res = rid == Py_None ? PyObject_CallMethodNoArgs(dom, s_pop_range)
                             : PyObject_CallMethodOneArg(dom, s_end_range, rid);
        if (res == NULL) {
            Py_DECREF(t1);
            return NULL;
        }
        Py_DECREF(res);
    }
    if (exact) {
        trace_id = SLOT(owner, region_slots.trace_id);
        thread_id = SLOT(owner, region_slots.thread_id);
        if (trace_id == NULL || thread_id == NULL) {
            PyErr_SetString(PyExc_AttributeError, "perfsdk: the owner region is not entered");
            Py_DECREF(t1);
            return NULL;
        }
        Py_INCREF(trace_id);
        Py_INCREF(thread_id);
    } else {
        trace_id = PyObject_GetAttrString(owner, "trace_id");
        thread_id = trace_id == NULL ? NULL : PyObject_GetAttrString(owner, "thread_id");
        if (thread_id == NULL) {
            Py_XDECREF(trace_id);
            Py_DECREF(t1);
            return NULL;
        }
    }
    if ((record = PyTuple_New(15)) == NULL) {
        Py_DECREF(trace_id);
        Py_DECREF(thread_id);
        Py_DECREF(t1);
        return NULL;
    }
    PyTuple_SET_ITEM(record, 0, Py_NewRef(PyTuple_GET_ITEM(self, 1)));
    PyTuple_SET_ITEM(record, 1, trace_id);
    PyTuple_SET_ITEM(record, 2, Py_NewRef(PyTuple_GET_ITEM(self, 2)));
    PyTuple_SET_ITEM(record, 3, Py_NewRef(PyTuple_GET_ITEM(self, 3)));
    PyTuple_SET_ITEM(record, 4, Py_NewRef(PyTuple_GET_ITEM(self, 7)));
    PyTuple_SET_ITEM(record, 5, t1);
    PyTuple_SET_ITEM(record, 6, thread_id);
    PyTuple_SET_ITEM(record, 7, Py_NewRef(error));
    for (i = 8; i < 15; i++) {
        PyTuple_SET_ITEM(record, i, Py_NewRef(Py_None));
    }
    truth = enqueue_record(record);
    Py_DECREF(record);
    if (truth < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef inner_exit_def = {
    "exit", (PyCFunction)(void (*)(void))inner_exit, METH_FASTCALL | METH_KEYWORDS,
    "exit(error=None, t1=0): end the entry; its record goes to the pipeline (compiled).",
};

/* new_id(bits): the next id of the compiled generator (64 or 128 bits, never 0). */
static PyObject *
fastpath_new_id(PyObject *module, PyObject *arg)
{
    long bits = PyLong_AsLong(arg);
    if (bits != 64 && bits != 128) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "new_id: bits=%R; accepted values are 64 and 128",
                         arg);
        }
        return NULL;
    }
    return random_id(NULL, (int)bits);
}

/* bind_inner(globals, InnerRegion, Region, NULL_REGION, state, fork, Context or None)
 * -> the compiled InnerRegion.exit (a method descriptor of InnerRegion). */
static PyObject *
fastpath_bind_inner(PyObject *module, PyObject *args)
{
    PyObject *globals, *inner, *region, *null, *state, *fork, *context, *pipeline;
    RegionSlots rs;
    StateSlots ss;
    Py_ssize_t generation, started, max_pending;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOO:bind_inner", &PyDict_Type, &globals, &PyType_Type,
                          &inner, &PyType_Type, &region, &null, &state, &fork, &context)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)inner, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "bind_inner: InnerRegion must be a tuple subclass");
        return NULL;
    }
    if (context != Py_None && !PyType_Check(context)) {
        PyErr_SetString(PyExc_TypeError, "bind_inner: Context must be a type or None");
        return NULL;
    }
    rs.type = (PyTypeObject *)region;
    ss.type = Py_TYPE(state);
#define OFFSET(var, type, name) if ((var = slot_offset(type, name)) < 0) return NULL;
    OFFSET(rs.timed, rs.type, "_timed")
    OFFSET(rs.t1, rs.type, "t1")
    OFFSET(rs.start_event, rs.type, "start_event")
    OFFSET(rs.thread_id, rs.type, "thread_id")
    OFFSET(rs.gen, rs.type, "_gen")
    OFFSET(rs.inner_id, rs.type, "inner_id")
    OFFSET(rs.span_id, rs.type, "span_id")
    OFFSET(rs.trace_id, rs.type, "trace_id")
    OFFSET(ss.enabled, ss.type, "enabled")
    OFFSET(ss.sample_every, ss.type, "sample_every")
    OFFSET(ss.timing, ss.type, "timing")
    OFFSET(ss.nvtx, ss.type, "nvtx")
    OFFSET(ss.memory, ss.type, "memory")
    OFFSET(generation, Py_TYPE(fork), "generation")
    if ((pipeline = global(globals, s_PIPELINE)) == NULL) {
        return NULL;
    }
    OFFSET(started, Py_TYPE(pipeline), "started")
    OFFSET(max_pending, Py_TYPE(pipeline), "max_pending")
#undef OFFSET
    Py_XSETREF(pipeline_type, (PyTypeObject *)Py_NewRef(Py_TYPE(pipeline)));
    pipeline_slots.started = started;
    pipeline_slots.max_pending = max_pending;
    Py_INCREF(rs.type);
    Py_INCREF(ss.type);
    Py_XDECREF(region_slots.type);
    Py_XDECREF(state_slots.type);
    region_slots = rs;
    state_slots = ss;
    Py_XSETREF(fork_type, (PyTypeObject *)Py_NewRef(Py_TYPE(fork)));
    fork_generation = generation;
    Py_XSETREF(context_type, context == Py_None ? NULL : (PyTypeObject *)Py_NewRef(context));
    Py_XSETREF(region_globals, Py_NewRef(globals));
    Py_XSETREF(inner_type, (PyTypeObject *)Py_NewRef(inner));
    Py_XSETREF(null_region, Py_NewRef(null));
    {
        PyObject *time = PyImport_ImportModule("time"), *clock, *bits;
        clock = time == NULL ? NULL : PyObject_GetAttrString(time, "perf_counter_ns");
        Py_XDECREF(time);
        if (clock == NULL) {
            return NULL;
        }
        Py_XSETREF(perf_counter_ns, clock);
        if ((bits = global(globals, s__getrandbits)) == NULL) {
            return NULL;
        }
        Py_XSETREF(ids_getrandbits, Py_NewRef(bits));
    }
    Py_XSETREF(inner_exit_descr, PyDescr_NewMethod(inner_type, &inner_exit_def));
    return Py_XNewRef(inner_exit_descr);
}

/* ---- a phase's with block: PhaseEnter and PhaseExit ------------------------------------
 *
 * perfsdk.phases.phase keeps one of each per instance (its _enter and _exit), and its
 * __enter__ and __exit__ are method descriptors made here (bind_phase) that call them without
 * a Python frame: PhaseEnter(gate, active)() is active.append(gate()), and
 * PhaseExit(active, many)(error) ends this thread's entry: the only one (the usual case) is
 * popped and exited here; several open at once (one phase object in several threads) are
 * many(active, error)'s, in Python; none (entered while torch.compile traced) is nothing. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *gate;
    PyObject *active; /* a list */
    PyObject *many;
} PhaseCallObject;

static PyObject *
phase_enter_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PhaseCallObject *self = (PhaseCallObject *)op;
    PyObject *entry;
    int failed;
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "PhaseEnter takes no arguments");
        return NULL;
    }
    entry = Py_TYPE(self->gate) == &InnerGateType ? gate_open((InnerGateObject *)self->gate)
                                                  : PyObject_CallNoArgs(self->gate);
    if (entry == NULL) {
        return NULL;
    }
    failed = PyList_Append(self->active, entry);
    Py_DECREF(entry);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
phase_exit_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PhaseCallObject *self = (PhaseCallObject *)op;
    PyObject *entry, *error, *res;
    Py_ssize_t n;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "PhaseExit takes one argument (error)");
        return NULL;
    }
    error = args[0];
    n = PyList_GET_SIZE(self->active);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    if (n > 1) {
        return PyObject_CallFunctionObjArgs(self->many, self->active, error, NULL);
    }
    entry = list_pop_last(self->active); /* the only one */
    if (Py_TYPE(entry) == inner_type && _PyType_Lookup(inner_type, s_exit) == inner_exit_descr) {
        res = inner_exit(entry, &error, 1, NULL);
    } else {
        res = PyObject_CallMethodOneArg(entry, s_exit, error);
    }
    Py_DECREF(entry);
    return res;
}

static PyObject *
phase_call_new(PyTypeObject *type, PyObject *args, PyObject *kwargs, int enter)
{
    PyObject *first, *second;
    PhaseCallObject *self;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)
        || !PyArg_ParseTuple(args, enter ? "OO!:PhaseEnter" : "O!O:PhaseExit",
                             enter ? (void *)&first : (void *)&PyList_Type,
                             enter ? (void *)&PyList_Type : (void *)&first,
                             enter ? (void *)&second : (void *)&second)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "takes no keyword arguments");
        }
        return NULL;
    }
    if ((self = (PhaseCallObject *)type->tp_alloc(type, 0)) == NULL) {
        return NULL;
    }
    if (enter) {
        self->vectorcall = phase_enter_vectorcall;
        self->gate = Py_NewRef(first);
        self->active = Py_NewRef(second);
    } else {
        self->vectorcall = phase_exit_vectorcall;
        self->active = Py_NewRef(first);
        self->many = Py_NewRef(second);
    }
    return (PyObject *)self;
}

static PyObject *
phase_enter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    return phase_call_new(type, args, kwargs, 1);
}

static PyObject *
phase_exit_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    return phase_call_new(type, args, kwargs, 0);
}

static int
phase_call_traverse(PyObject *op, visitproc visit, void *arg)
{
    PhaseCallObject *self = (PhaseCallObject *)op;
    Py_VISIT(self->gate);
    Py_VISIT(self->active);
    Py_VISIT(self->many);
    return 0;
}

static int
phase_call_clear(PyObject *op)
{
    PhaseCallObject *self = (PhaseCallObject *)op;
    Py_CLEAR(self->gate);
    Py_CLEAR(self->active);
    Py_CLEAR(self->many);
    return 0;
}

static void
phase_call_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    phase_call_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyTypeObject PhaseEnterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.PhaseEnter",
    .tp_doc = "PhaseEnter(gate, active)(): active.append(gate()), compiled.",
    .tp_basicsize = sizeof(PhaseCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(PhaseCallObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = phase_enter_new,
    .tp_dealloc = phase_call_dealloc,
    .tp_traverse = phase_call_traverse,
    .tp_clear = phase_call_clear,
};

static PyTypeObject PhaseExitType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.PhaseExit",
    .tp_doc = "PhaseExit(active, many)(error): end this thread's entry of a phase, compiled.",
    .tp_basicsize = sizeof(PhaseCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(PhaseCallObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = phase_exit_new,
    .tp_dealloc = phase_call_dealloc,
    .tp_traverse = phase_call_traverse,
    .tp_clear = phase_call_clear,
};

/* phase.__enter__ and phase.__exit__ (bind_phase): the instance's PhaseEnter / PhaseExit,
 * read from its slots; an instance without them (the Python gates chosen) calls the Python
 * methods handed over. torch.compile does not trace a phase's with block either way: dynamo
 * does not enter a context manager made outside the compiled code (a graph break). */
static Py_ssize_t phase_enter_slot, phase_exit_slot;
static PyObject *phase_enter_python, *phase_exit_python;

/* (defs[0], defs[1]) as method descriptors of `cls`: a with block's compiled __enter__ and
 * __exit__ (new reference). */
static PyObject *
method_pair(PyTypeObject *cls, PyMethodDef *defs)
{
    PyObject *enter, *leave, *result;
    if ((enter = PyDescr_NewMethod(cls, &defs[0])) == NULL) {
        return NULL;
    }
    if ((leave = PyDescr_NewMethod(cls, &defs[1])) == NULL) {
        Py_DECREF(enter);
        return NULL;
    }
    result = PyTuple_Pack(2, enter, leave);
    Py_DECREF(enter);
    Py_DECREF(leave);
    return result;
}

static PyObject *
phase_method_enter(PyObject *self, PyObject *unused)
{
    PyObject *enter = SLOT(self, phase_enter_slot);
    if (enter != NULL && Py_TYPE(enter) == &PhaseEnterType) {
        return phase_enter_vectorcall(enter, NULL, 0, NULL);
    }
    return PyObject_CallOneArg(phase_enter_python, self);
}

static PyObject *
phase_method_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *leave = SLOT(self, phase_exit_slot), *stack[4];
    if (nargs == 3 && leave != NULL && Py_TYPE(leave) == &PhaseExitType) {
        return phase_exit_vectorcall(leave, args + 1, 1, NULL); /* (exc_type, exc, tb): exc */
    }
    if (nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "phase.__exit__ takes 3 arguments");
        return NULL;
    }
    stack[0] = self;
    memcpy(stack + 1, args, (size_t)nargs * sizeof(PyObject *));
    return PyObject_Vectorcall(phase_exit_python, stack, nargs + 1, NULL);
}

static PyMethodDef phase_method_defs[] = {
    {"__enter__", phase_method_enter, METH_NOARGS, "Enter the phase (compiled)."},
    {"__exit__", (PyCFunction)(void (*)(void))phase_method_exit, METH_FASTCALL,
     "Leave the phase (compiled)."},
};

/* bind_phase(phase, python __enter__, python __exit__) -> (__enter__, __exit__): the compiled
 * methods, for the class to take. */
static PyObject *
fastpath_bind_phase(PyObject *module, PyObject *args)
{
    PyTypeObject *cls;
    PyObject *enter, *leave, *result;
    Py_ssize_t enter_slot, exit_slot;
    if (!PyArg_ParseTuple(args, "O!OO:bind_phase", &PyType_Type, &cls, &enter, &leave)) {
        return NULL;
    }
    if (!PyCallable_Check(enter) || !PyCallable_Check(leave)) {
        PyErr_SetString(PyExc_TypeError, "bind_phase: the Python methods must be callable");
        return NULL;
    }
    if ((enter_slot = slot_offset(cls, "_enter")) < 0
        || (exit_slot = slot_offset(cls, "_exit")) < 0) {
        return NULL;
    }
    if ((result = method_pair(cls, phase_method_defs)) == NULL) {
        return NULL;
    }
    phase_enter_slot = enter_slot;
    phase_exit_slot = exit_slot;
    Py_XSETREF(phase_enter_python, Py_NewRef(enter));
    Py_XSETREF(phase_exit_python, Py_NewRef(leave));
    return result;
}

/* ---- a step's region: Region._start and Region.exit, their common case compiled ----------
 *
 * RegionStart(spec)(attributes) is perfsdk.region._start_python(spec, attributes) (a fresh
 * Region, entered) and region_exit(region, error, t1) is region.exit(error, t1), without a
 * Python frame, for an entry on the host: timing on, the pipeline started, no torch profiler,
 * no memory readings, CUDA not initialized, a push/pop NVTX range (or none), the parent a
 * Region or nothing, a thread already noted. Anything else goes to the Python code, decided
 * before anything is done. The steps of perfsdk.auto use them (bind_region). */
typedef struct {
    Py_ssize_t attributes, gen, mem, nvtx, rf, timed, token, device_ms, end_event, entered,
        error, events, inner_id, memory, parent_id, resolved, span_id, spec, start_event, t0,
        t1, thread_id, trace_id;
} FullSlots;
static FullSlots full_slots;
static int full_bound;
static PyObject *device_globals;     /* perfsdk._device's module dict */
static PyObject *cuda_is_initialized; /* torch.cuda.is_initialized */
static PyObject *cuda_globals;       /* torch.cuda's module dict */
static PyObject *int_zero;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *spec;
    SpecRange range;
    PyObject *every; /* spec.every, for the gate (RegionStart(spec, gate=True)) */
} RegionStartObject;

/* 1: CUDA is initialized (or cannot tell), 0: not, -1: error. torch.cuda.is_initialized() is
 * `_initialized and not _is_in_bad_fork()`: its module global read, false in the common case. */
static int
cuda_initialized(void)
{
    PyObject *fn, *value;
    int truth;
    if ((fn = global(device_globals, s__is_initialized)) == NULL) {
        return -1;
    }
    if (fn == cuda_is_initialized) {
        if ((value = global(cuda_globals, s__initialized)) == NULL) {
            return -1;
        }
        return PyObject_IsTrue(value) != 0;
    }
    if ((value = PyObject_CallNoArgs(fn)) == NULL) {
        return -1;
    }
    truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyTypeObject RssPeakType;
static PyObject *rsspeak_baseline(PyObject *op, PyObject *unused);
static PyObject *rsspeak_host_exit(PyObject *op, PyObject *rss0);

/* perfsdk.region's _memory.TRACKER.rss, the host's peak-RSS readings (new reference), or NULL
 * with an exception set. */
static PyObject *
host_rss(void)
{
    PyObject *module = global(region_globals, s__memory), *tracker, *rss;
    if (module == NULL || (tracker = PyObject_GetAttr(module, s_TRACKER)) == NULL) {
        return NULL;
    }
    rss = PyObject_GetAttr(tracker, s_rss);
    Py_DECREF(tracker);
    return rss;
}

/* 1: the entry takes the compiled path, 0: the Python one, -1: error. Sets *context (new
 * reference) and *parent (borrowed from it) on 1, and *memory to whether the entry takes a
 * peak-RSS reading (memory=True on the host). */
static int
rstart_fast(RegionStartObject *self, PyObject *state, PyObject **context, PyObject **parent,
            int *memory, PyObject **thread)
{
    PyObject *value, *key, *pipeline, *profiling;
    int truth;
    if (!full_bound || current_var == NULL || self->range.asynchronous) {
        return 0;
    }
    if ((value = SLOT(state, state_slots.timing)) == NULL
        || (truth = PyObject_IsTrue(value)) <= 0) {
        return value == NULL ? 0 : truth;
    }
    /* PIPELINE.started */
    if ((pipeline = global(region_globals, s_PIPELINE)) == NULL
        || (value = pipeline_attr(pipeline, pipeline_slots.started, s_started)) == NULL) {
        return -1;
    }
    truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (truth <= 0) {
        return truth;
    }
    /* not _torch_profiler._is_profiler_enabled */
    if ((profiling = global(region_globals, s__torch_profiler)) == NULL) {
        return -1;
    }
    if (!PyModule_CheckExact(profiling)) {
        return 0;
    }
    if ((profiling = global(PyModule_GetDict(profiling), s__is_profiler_enabled)) == NULL
        || (truth = PyObject_IsTrue(profiling)) != 0) {
        return profiling == NULL ? -1 : (truth < 0 ? -1 : 0);
    }
    /* memory or (memory is None and _state.memory): a peak-RSS reading (host_memory) */
    value = self->range.memory == Py_None ? SLOT(state, state_slots.memory) : self->range.memory;
    if (value == NULL || (truth = PyObject_IsTrue(value)) < 0) {
        return value == NULL ? 0 : -1;
    }
    *memory = truth;
    if ((truth = cuda_initialized()) != 0) {
        return truth < 0 ? -1 : 0;
    }
    /* the thread noted (`ident in _noted`) */
    {
        PyObject *noted = global(region_globals, s__noted), *ident;
        if (noted == NULL) {
            return -1;
        }
        if (!PySet_Check(noted)
            || (ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident())) == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        if ((truth = PySet_Contains(noted, ident)) <= 0) {
            Py_DECREF(ident);
            return truth;
        }
        *thread = ident; /* the region's thread_id: one int made, not two */
    }
    /* the parent: the current span */
    if ((key = global(region_globals, s__SPAN_KEY)) == NULL
        || PyContextVar_Get(current_var, NULL, context) < 0) {
        Py_CLEAR(*thread);
        return -1;
    }
    if (*context == NULL) {
        Py_CLEAR(*thread);
        return 0;
    }
    if (key == Py_None) {
        *parent = *context;
    } else if (PyDict_CheckExact(*context) || Py_TYPE(*context) == context_type) {
        if ((*parent = PyDict_GetItemWithError(*context, key)) == NULL) {
            if (PyErr_Occurred()) {
                Py_CLEAR(*context);
                Py_CLEAR(*thread);
                return -1;
            }
            *parent = Py_None;
        }
    } else {
        Py_CLEAR(*context);
        Py_CLEAR(*thread);
        return 0;
    }
    if (*parent != Py_None && Py_TYPE(*parent) != region_slots.type) {
        Py_CLEAR(*context); /* a span of the user's: the Python code asks it for its ids */
        Py_CLEAR(*thread);
        return 0;
    }
    return 1;
}

/* _Context({**context, key: value}) (new reference). OpenTelemetry's Context is a dict
 * subclass without a __new__ or __init__ of its own: built as dict(...) builds it, one dict
 * made and filled here (no copy to hand over, no call through the type); another Context
 * class is called. */
static PyObject *
new_context(PyObject *cls, PyObject *context, PyObject *key, PyObject *value)
{
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *made, *values;
    if (PyType_Check(cls) && type == context_type && type->tp_new == PyDict_Type.tp_new
        && type->tp_init == PyDict_Type.tp_init) {
        PyObject *empty = PyTuple_New(0);
        made = empty == NULL ? NULL : type->tp_new(type, empty, NULL);
        Py_XDECREF(empty);
        if (made != NULL && (PyDict_Merge(made, context, 1) < 0
                             || PyDict_SetItem(made, key, value) < 0)) {
            Py_CLEAR(made);
        }
        return made;
    }
    if ((values = PyDict_Copy(context)) == NULL || PyDict_SetItem(values, key, value) < 0) {
        Py_XDECREF(values);
        return NULL;
    }
    made = PyObject_CallOneArg(cls, values);
    Py_DECREF(values);
    return made;
}

#define FSET(obj, field, value) (SLOT(obj, full_slots.field) = (value))

static PyObject *
rstart_call(RegionStartObject *self, PyObject *attributes)
{
    PyObject *state, *context = NULL, *parent = NULL, *region, *dom = Py_None, *fork, *fn;
    PyObject *trace_id = NULL, *parent_id = NULL, *span_id = NULL, *token = NULL, *t0, *key;
    PyObject *gen, *thread = NULL;
    int fast, truth, memory = 0;
    if ((state = global(region_globals, s__state)) == NULL) {
        return NULL;
    }
    if (Py_TYPE(state) != state_slots.type) {
        fast = 0;
    } else if ((fast = rstart_fast(self, state, &context, &parent, &memory, &thread)) < 0) {
        return NULL;
    }
    if ((fork = global(region_globals, s__FORK)) == NULL) {
        Py_XDECREF(context);
        Py_XDECREF(thread);
        return NULL;
    }
    if (fast && (Py_TYPE(fork) != fork_type || (gen = SLOT(fork, fork_generation)) == NULL)) {
        Py_CLEAR(context);
        Py_CLEAR(thread);
        fast = 0;
    }
    if (!fast) {
        if ((fn = global(region_globals, s__start_python)) == NULL) {
            return NULL;
        }
        return PyObject_CallFunctionObjArgs(fn, self->spec, attributes, NULL);
    }
    /* the NVTX range, when _state.nvtx and the spec has a domain (a push/pop range: the fast
     * path has no start/end ones, so no range id) */
    if (self->range.push != Py_None) {
        PyObject *value = SLOT(state, state_slots.nvtx), *rid = Py_None;
        if (value == NULL || (truth = PyObject_IsTrue(value)) < 0) {
            if (value == NULL) {
                PyErr_SetString(PyExc_AttributeError, "perfsdk: settings without nvtx");
            }
            Py_DECREF(context);
            Py_DECREF(thread);
            return NULL;
        }
        if (truth && spec_range_push(&self->range, &dom, &rid) < 0) {
            Py_DECREF(context);
            Py_DECREF(thread);
            return NULL;
        }
    }
    if ((region = region_slots.type->tp_alloc(region_slots.type, 0)) == NULL) {
        Py_DECREF(context);
        Py_DECREF(thread);
        return NULL;
    }
    FSET(region, thread_id, thread); /* rstart_fast's: the ident it found noted */
    FSET(region, spec, Py_NewRef(self->spec));
    FSET(region, attributes, Py_NewRef(attributes));
    FSET(region, events, Py_NewRef(Py_None));
    FSET(region, start_event, Py_NewRef(Py_None));
    FSET(region, end_event, Py_NewRef(Py_None));
    FSET(region, device_ms, Py_NewRef(Py_None));
    FSET(region, error, Py_NewRef(Py_None));
    FSET(region, memory, Py_NewRef(Py_None));
    FSET(region, resolved, Py_NewRef(Py_False));
    FSET(region, entered, Py_NewRef(Py_True));
    FSET(region, inner_id, Py_NewRef(int_zero));
    FSET(region, t1, Py_NewRef(int_zero));
    FSET(region, rf, Py_NewRef(Py_None));
    FSET(region, mem, Py_NewRef(Py_None));
    FSET(region, nvtx, Py_NewRef(dom));
    FSET(region, timed, Py_NewRef(Py_True));
    FSET(region, gen, Py_NewRef(gen));
    /* ids: the parent's trace, else a new one */
    if ((fn = global(region_globals, s__getrandbits)) == NULL) {
        goto fail;
    }
    if (parent != Py_None) {
        PyObject *inner = SLOT(parent, region_slots.inner_id);
        trace_id = SLOT(parent, region_slots.trace_id);
        parent_id = SLOT(parent, region_slots.span_id);
        if (trace_id == NULL || parent_id == NULL || inner == NULL) {
            PyErr_SetString(PyExc_AttributeError, "perfsdk: the parent region is not entered");
            goto fail;
        }
        if ((truth = PyObject_IsTrue(inner)) < 0) {
            goto fail;
        }
        Py_INCREF(trace_id);
        parent_id = Py_NewRef(truth ? inner : parent_id);
    } else if ((trace_id = random_id(fn, 128)) == NULL) {
        goto fail;
    } else {
        parent_id = Py_NewRef(int_zero);
    }
    FSET(region, trace_id, trace_id);
    FSET(region, parent_id, parent_id);
    if ((span_id = random_id(fn, 64)) == NULL) {
        goto fail;
    }
    FSET(region, span_id, span_id);
    /* the current span: this region */
    if ((key = global(region_globals, s__SPAN_KEY)) == NULL) {
        goto fail;
    }
    if (key == Py_None) {
        token = PyContextVar_Set(current_var, region);
    } else if ((fn = global(region_globals, s__Context)) == NULL) {
        goto fail;
    } else {
        PyObject *made;
        if ((made = new_context(fn, context, key, region)) == NULL) {
            goto fail;
        }
        token = PyContextVar_Set(current_var, made);
        Py_DECREF(made);
    }
    if (token == NULL) {
        goto fail;
    }
    FSET(region, token, token);
    if (memory) { /* self._mem = _memory.TRACKER.rss.baseline() */
        PyObject *rss = host_rss(), *mem;
        if (rss == NULL) {
            goto fail;
        }
        mem = Py_TYPE(rss) == &RssPeakType ? rsspeak_baseline(rss, NULL)
                                          : PyObject_CallMethodNoArgs(rss, s_baseline);
        Py_DECREF(rss);
        if (mem == NULL) {
            goto fail;
        }
        Py_SETREF(SLOT(region, full_slots.mem), mem);
    }
    if ((fn = global(region_globals, s__perf_ns)) == NULL || (t0 = clock_read(fn)) == NULL) {
        goto fail;
    }
    FSET(region, t0, t0);
    Py_DECREF(context);
    return region;
fail:
    Py_DECREF(context);
    Py_DECREF(region);
    return NULL;
}

static PyObject *
rstart_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "RegionStart takes one argument (attributes)");
        return NULL;
    }
    return rstart_call((RegionStartObject *)op, args[0]);
}

/* A gate's call: spec.open(attributes), compiled where perfsdk is enabled and timed: the
 * sampling decision (n = spec.every or PERFSDK_SAMPLE_EVERY; n != 1: next(spec.calls) % n,
 * as in Python), then the entry itself (rstart_call) or NULL_REGION; disabled: NULL_REGION;
 * anything else: spec.open(attributes) in Python. */
static PyObject *
rgate_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    RegionStartObject *self = (RegionStartObject *)op;
    PyObject *state, *enabled, *n, *attributes;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int overflow, truth;
    long rate;
    if (nargs > 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a gate takes at most one argument (attributes)");
        return NULL;
    }
    attributes = nargs ? args[0] : Py_None;
    if ((state = global(region_globals, s__state)) == NULL) {
        return NULL;
    }
    if (Py_TYPE(state) == state_slots.type && (enabled = SLOT(state, state_slots.enabled)) != NULL
        && (enabled == Py_True || enabled == Py_False)) {
        if (enabled == Py_False) {
            return Py_NewRef(null_region);
        }
        n = self->every == Py_None ? SLOT(state, state_slots.sample_every) : self->every;
        if (n != NULL && PyLong_CheckExact(n) && SLOT(state, state_slots.timing) == Py_True
            && ((rate = PyLong_AsLongAndOverflow(n, &overflow)) == 1 || self->range.calls)) {
            if (rate == -1 && PyErr_Occurred()) {
                return NULL;
            }
            if (rate != 1 && (truth = sampled_out(&self->range, n)) != 0) {
                return truth < 0 ? NULL : Py_NewRef(null_region);
            }
            return rstart_call(self, attributes); /* falls back on _start_python: unsampled */
        }
    }
    return PyObject_CallMethodOneArg(self->spec, s_open, attributes);
}

static PyObject *
rstart_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *spec;
    RegionStartObject *self;
    int gate = 0;
    static char *keywords[] = {"spec", "gate", NULL};
    if (region_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "perfsdk._fastpath: bind_inner() was not called");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p:RegionStart", keywords, &spec, &gate)) {
        return NULL;
    }
    if ((self = (RegionStartObject *)type->tp_alloc(type, 0)) == NULL) {
        return NULL;
    }
    self->vectorcall = gate ? rgate_vectorcall : rstart_vectorcall;
    self->spec = Py_NewRef(spec);
    if (spec_range_read(&self->range, spec) < 0
        || (gate && (self->every = PyObject_GetAttr(spec, s_every)) == NULL)) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
rstart_traverse(PyObject *op, visitproc visit, void *arg)
{
    RegionStartObject *self = (RegionStartObject *)op;
    Py_VISIT(self->spec);
    Py_VISIT(self->every);
    return spec_range_traverse(&self->range, visit, arg);
}

static int
rstart_clear(PyObject *op)
{
    RegionStartObject *self = (RegionStartObject *)op;
    Py_CLEAR(self->spec);
    Py_CLEAR(self->every);
    spec_range_clear(&self->range);
    return 0;
}

static void
rstart_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    rstart_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
rstart_repr(PyObject *op)
{
    return PyUnicode_FromFormat("<perfsdk._fastpath.RegionStart %R>",
                                ((RegionStartObject *)op)->spec);
}

static PyTypeObject RegionStartType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.RegionStart",
    .tp_doc = "RegionStart(spec, gate=False): start(attributes) is "
              "perfsdk.region._start_python(spec, attributes), compiled (after bind_inner and "
              "bind_region); with gate=True, start(attributes=None) is spec.open(attributes).",
    .tp_basicsize = sizeof(RegionStartObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(RegionStartObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = rstart_new,
    .tp_dealloc = rstart_dealloc,
    .tp_traverse = rstart_traverse,
    .tp_clear = rstart_clear,
    .tp_repr = rstart_repr,
};

/* region_exit(region, error, t1): region.exit(error, t1); compiled for an entry that
 * RegionStart's fast path could have made, ending without an error. */
static PyObject *
fastpath_region_exit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *region, *error, *t1, *value, *dom, *token, *record, *spec, *index, *fn;
    PyObject *fork, *mem, *memory = Py_None;
    int truth, i;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "region_exit(region, error, t1) takes 3 arguments");
        return NULL;
    }
    region = args[0];
    error = args[1];
    t1 = args[2];
    if (!full_bound || current_var == NULL || Py_TYPE(region) != region_slots.type
        || error != Py_None || SLOT(region, full_slots.timed) != Py_True
        || SLOT(region, full_slots.start_event) != Py_None
        || (mem = SLOT(region, full_slots.mem)) == NULL
        || (mem != Py_None && !PyLong_CheckExact(mem)) /* None, or a peak-RSS baseline */
        || SLOT(region, full_slots.rf) != Py_None
        || (token = SLOT(region, full_slots.token)) == NULL || token == Py_None
        || (dom = SLOT(region, full_slots.nvtx)) == NULL
        || (spec = SLOT(region, full_slots.spec)) == NULL
        || SLOT(region, full_slots.t0) == NULL || SLOT(region, full_slots.trace_id) == NULL
        || SLOT(region, full_slots.span_id) == NULL
        || SLOT(region, full_slots.parent_id) == NULL
        || SLOT(region, full_slots.thread_id) == NULL
        || SLOT(region, full_slots.attributes) == NULL
        || SLOT(region, full_slots.events) == NULL
#ifdef PERFSDK_NVTX
        || (dom != Py_None && Py_TYPE(dom) != &NvtxCallType)
#else
        || dom != Py_None
#endif
        ) {
        goto python;
    }
    if ((fork = global(region_globals, s__FORK)) == NULL) {
        return NULL;
    }
    if (Py_TYPE(fork) != fork_type || (value = SLOT(region, full_slots.gen)) == NULL
        || SLOT(fork, fork_generation) == NULL) {
        goto python;
    }
    if ((truth = PyObject_RichCompareBool(value, SLOT(fork, fork_generation), Py_EQ)) <= 0) {
        if (truth < 0) {
            return NULL;
        }
        goto python;
    }
    if ((index = PyObject_GetAttr(spec, s_index)) == NULL) {
        return NULL;
    }
    /* if not t1: t1 = _perf_ns() */
    if ((truth = PyObject_IsTrue(t1)) < 0) {
        Py_DECREF(index);
        return NULL;
    }
    if (truth) {
        Py_INCREF(t1);
    } else if ((fn = global(region_globals, s__perf_ns)) == NULL || (t1 = clock_read(fn)) == NULL) {
        Py_DECREF(index);
        return NULL;
    }
    Py_XSETREF(SLOT(region, full_slots.t1), Py_NewRef(t1));
    if (mem != Py_None) { /* self.memory = _memory.TRACKER.rss.host_exit(mem) */
        PyObject *rss = host_rss();
        memory = rss == NULL ? NULL
                 : Py_TYPE(rss) == &RssPeakType ? rsspeak_host_exit(rss, mem)
                                                 : PyObject_CallMethodOneArg(rss, s_host_exit, mem);
        Py_XDECREF(rss);
        if (memory == NULL) {
            Py_DECREF(index);
            Py_DECREF(t1);
            return NULL;
        }
        Py_XSETREF(SLOT(region, full_slots.memory), memory); /* the record takes its own */
    }
    Py_XSETREF(SLOT(region, full_slots.resolved), Py_NewRef(Py_True));
    /* the current context back; the token dropped (fewer live objects) */
    SLOT(region, full_slots.token) = Py_NewRef(Py_None); /* ours now: `token` */
    if (PyContextVar_Reset(current_var, token) < 0) { /* a token of another context */
        PyErr_Clear();
        if ((fn = global(region_globals, s__detach)) == NULL
            || (value = PyObject_CallOneArg(fn, token)) == NULL) {
            PyErr_Clear(); /* as the Python exit, which records the region all the same */
        } else {
            Py_DECREF(value);
        }
    }
    Py_DECREF(token);
#ifdef PERFSDK_NVTX
    if (dom != Py_None) {
        nvtxDomainRangePop(((NvtxCallObject *)dom)->domain);
    }
#endif
    if ((record = PyTuple_New(15)) == NULL) {
        Py_DECREF(index);
        Py_DECREF(t1);
        return NULL;
    }
    PyTuple_SET_ITEM(record, 0, index);
    PyTuple_SET_ITEM(record, 1, Py_NewRef(SLOT(region, full_slots.trace_id)));
    PyTuple_SET_ITEM(record, 2, Py_NewRef(SLOT(region, full_slots.span_id)));
    PyTuple_SET_ITEM(record, 3, Py_NewRef(SLOT(region, full_slots.parent_id)));
    PyTuple_SET_ITEM(record, 4, Py_NewRef(SLOT(region, full_slots.t0)));
    PyTuple_SET_ITEM(record, 5, t1);
    PyTuple_SET_ITEM(record, 6, Py_NewRef(SLOT(region, full_slots.thread_id)));
    PyTuple_SET_ITEM(record, 7, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(record, 8, Py_NewRef(SLOT(region, full_slots.attributes)));
    PyTuple_SET_ITEM(record, 9, Py_NewRef(SLOT(region, full_slots.events)));
    PyTuple_SET_ITEM(record, 10, Py_NewRef(memory));
    for (i = 11; i < 15; i++) {
        PyTuple_SET_ITEM(record, i, Py_NewRef(Py_None));
    }
    truth = enqueue_record(record);
    Py_DECREF(record);
    if (truth < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
python:
    return PyObject_CallMethodObjArgs(region, s_exit, error, t1, NULL);
}

/* bind_region(CURRENT or None, perfsdk._device's globals, torch.cuda): for RegionStart and
 * region_exit (after bind_inner). */
static PyObject *
fastpath_bind_region(PyObject *module, PyObject *args)
{
    PyObject *current, *device, *cuda, *is_init;
    FullSlots fs;
    PyTypeObject *type = region_slots.type;
    if (!PyArg_ParseTuple(args, "OO!O!:bind_region", &current, &PyDict_Type, &device,
                          &PyModule_Type, &cuda)) {
        return NULL;
    }
    if (type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind_region: bind_inner() was not called");
        return NULL;
    }
    if (current != Py_None && !PyContextVar_CheckExact(current)) {
        PyErr_SetString(PyExc_TypeError, "bind_region: CURRENT must be a ContextVar or None");
        return NULL;
    }
#define OFFSET(name, text) if ((fs.name = slot_offset(type, text)) < 0) return NULL;
    OFFSET(attributes, "_attributes") OFFSET(gen, "_gen") OFFSET(mem, "_mem")
    OFFSET(nvtx, "_nvtx") OFFSET(rf, "_rf") OFFSET(timed, "_timed") OFFSET(token, "_token")
    OFFSET(device_ms, "device_ms") OFFSET(end_event, "end_event") OFFSET(entered, "entered")
    OFFSET(error, "error") OFFSET(events, "events") OFFSET(inner_id, "inner_id")
    OFFSET(memory, "memory") OFFSET(parent_id, "parent_id") OFFSET(resolved, "resolved")
    OFFSET(span_id, "span_id") OFFSET(spec, "spec") OFFSET(start_event, "start_event")
    OFFSET(t0, "t0") OFFSET(t1, "t1") OFFSET(thread_id, "thread_id")
    OFFSET(trace_id, "trace_id")
#undef OFFSET
    if ((is_init = PyObject_GetAttrString(cuda, "is_initialized")) == NULL) {
        return NULL;
    }
    if (int_zero == NULL && (int_zero = PyLong_FromLong(0)) == NULL) {
        Py_DECREF(is_init);
        return NULL;
    }
    full_slots = fs;
    if (current != Py_None) {
        PyObject *get = PyObject_GetAttrString(current, "get");
        if (get == NULL) {
            Py_DECREF(is_init);
            return NULL;
        }
        contextvar_get = PyCFunction_Check(get) ? PyCFunction_GET_FUNCTION(get) : NULL;
        Py_DECREF(get);
    }
    Py_XSETREF(current_var, current == Py_None ? NULL : Py_NewRef(current));
    Py_XSETREF(device_globals, Py_NewRef(device));
    Py_XSETREF(cuda_is_initialized, is_init);
    Py_XSETREF(cuda_globals, Py_NewRef(PyModule_GetDict(cuda)));
    full_bound = 1;
    Py_RETURN_NONE;
}

/* The steps of perfsdk.auto (perfsdk/auto/steps.py), compiled: step_start(steps, samples,
 * flops, implicit) is _step_python's work and step_end(steps, step, error) is Steps._end's,
 * for a step of a loop without a schedule, listeners, flops or a torchrun run id, samples an
 * int (or None), perfsdk enabled. Anything else is handed to the Python code, decided before
 * anything is done. A step is the first Python work after a training step's torch
 * calls, where each Python frame costs microseconds: these leave none (bind_steps). */
static PyObject *steps_globals;  /* perfsdk.auto.steps's module dict */
static PyObject *dist_globals;   /* perfsdk.distributed's module dict */
static PyTypeObject *steps_type; /* perfsdk.auto.steps.Steps */
static PyTypeObject *step_type;  /* perfsdk.auto.steps.Step */
static PyObject *region_exit_fn; /* this module's region_exit */
static struct {
    Py_ssize_t steps, flops, index, phase, region, samples;
} step_slots;
/* Steps's __slots__, read and written at their offsets: in place, after a training step's torch
 * calls, a generic attribute lookup's cache misses (the type's method cache, the instance dict,
 * its keys) cost more than its instructions. An unset slot (NULL) hands the step to Python. */
static struct {
    Py_ssize_t indices, paused, current, explicit_, listeners, next_index, schedule;
} steps_slots;
#define STEPS_SLOT(steps, name) SLOT(steps, steps_slots.name)
static PyObject *k_step, *k_samples, *k_amp, *k_samples_per_s, *s_active_phase, *int_one;

/* Whether the steps are not paused and have no listeners (an empty list): what a compiled step
 * end needs; a compiled step start needs no schedule too. */
static int
steps_quiet(PyObject *steps)
{
    PyObject *listeners = STEPS_SLOT(steps, listeners);
    return STEPS_SLOT(steps, paused) == Py_False && listeners != NULL
           && PyList_CheckExact(listeners) && PyList_GET_SIZE(listeners) == 0;
}

/* Steps._end(step, error) compiled: 0 done (or nothing to do), 1 for the Python code (nothing
 * done), -1 error. */
static int
step_end_fast(PyObject *steps, PyObject *step, PyObject *error)
{
    PyObject *state, *region, *samples, *t0 = NULL, *t1, *fn, *attrs, *rate, *res, *args[3];
    PyObject *value;
    int truth;
    if (steps_type == NULL || Py_TYPE(steps) != steps_type || Py_TYPE(step) != step_type) {
        return 1;
    }
    if ((value = STEPS_SLOT(steps, current)) != step) {
        return value == NULL; /* already ended: as Python, nothing to do (unset: Python) */
    }
    if (!steps_quiet(steps)) {
        return 1;
    }
    if (SLOT(step, step_slots.flops) != Py_None || (region = SLOT(step, step_slots.region)) == NULL
        || (samples = SLOT(step, step_slots.samples)) == NULL) {
        return 1;
    }
    if ((state = global(steps_globals, s__state)) == NULL) {
        return -1;
    }
    if (Py_TYPE(state) != state_slots.type || SLOT(state, state_slots.memory) == NULL) {
        return 1;
    }
    if ((truth = PyObject_IsTrue(SLOT(state, state_slots.memory))) != 0) {
        return truth < 0 ? -1 : 1; /* memory readings at the step's end: Python */
    }
    if (region != Py_None && (Py_TYPE(region) != region_slots.type || !full_bound
                              || (t0 = SLOT(region, full_slots.t0)) == NULL)) {
        return 1;
    }
    Py_SETREF(STEPS_SLOT(steps, current), Py_NewRef(Py_None)); /* the caller holds the step */
    if (region == Py_None) {
        return 0;
    }
    Py_INCREF(region);
    Py_SETREF(SLOT(step, step_slots.region), Py_NewRef(Py_None));
    t1 = Py_NewRef(int_zero);
    if (samples != Py_None && (truth = PyObject_IsTrue(t0)) != 0) {
        long long begin, end;
        double seconds;
        if (truth < 0 || (fn = global(region_globals, s__perf_ns)) == NULL) {
            goto fail;
        }
        Py_SETREF(t1, clock_read(fn));
        if (t1 == NULL) {
            goto fail;
        }
        begin = AS_NS(t0);
        end = AS_NS(t1);
        if ((begin == -1 || end == -1) && PyErr_Occurred()) {
            goto fail;
        }
        seconds = (double)(end - begin) / 1e9;
        attrs = SLOT(region, full_slots.attributes);
        if (seconds > 0 && attrs != NULL && attrs != Py_None) {
            double count = PyLong_AsDouble(samples);
            if ((count == -1.0 && PyErr_Occurred())
                || (rate = PyFloat_FromDouble(count / seconds)) == NULL) {
                goto fail;
            }
            truth = PyObject_SetItem(attrs, k_samples_per_s, rate);
            Py_DECREF(rate);
            if (truth < 0) {
                goto fail;
            }
        }
    }
    if ((fn = global(region_globals, s_exit_region)) == NULL) {
        goto fail;
    }
    args[0] = region;
    args[1] = error;
    args[2] = t1;
    res = fn == region_exit_fn ? fastpath_region_exit(NULL, args, 3)
                               : PyObject_Vectorcall(fn, args, 3, NULL);
    Py_DECREF(region);
    Py_DECREF(t1);
    if (res == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
fail:
    Py_DECREF(region);
    Py_XDECREF(t1);
    return -1;
}

/* step_end(steps, step, error): Steps._end(steps, step, error), compiled where it can be. */
static PyObject *
fastpath_step_end(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int done;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "step_end(steps, step, error) takes 3 arguments");
        return NULL;
    }
    if ((done = step_end_fast(args[0], args[1], args[2])) < 0) {
        return NULL;
    }
    if (done) {
        return PyObject_CallMethodObjArgs(args[0], s__end, args[1], args[2], NULL);
    }
    Py_RETURN_NONE;
}

/* 1: step_start takes the compiled path, 0: the Python one, -1: error. *current is set
 * (borrowed from steps) on 1. */
static int
step_start_fast(PyObject *steps, PyObject *samples, PyObject *flops, PyObject **current)
{
    PyObject *state, *value, *keys;
    int truth;
    *current = NULL;
    if (steps_type == NULL || Py_TYPE(steps) != steps_type || flops != Py_None) {
        return 0;
    }
    if (samples != Py_None) { /* an int >= 1: else Python checks it (and raises) */
        if (!PyLong_CheckExact(samples)) {
            return 0;
        }
        int overflow;
        long count = PyLong_AsLongAndOverflow(samples, &overflow);
        if (overflow < 0 || (overflow == 0 && count < 1)) {
            return 0; /* Python raises, naming it (an int: no error here) */
        }
    }
    if (STEPS_SLOT(steps, schedule) != Py_None || !steps_quiet(steps)
        || STEPS_SLOT(steps, indices) == NULL
        || (value = STEPS_SLOT(steps, current)) == NULL
        || (value != Py_None && Py_TYPE(value) != step_type)) {
        return 0;
    }
    *current = value;
    if ((state = global(steps_globals, s__state)) == NULL) {
        return -1;
    }
    if (Py_TYPE(state) != state_slots.type || (value = SLOT(state, state_slots.enabled)) == NULL) {
        return 0;
    }
    if ((truth = PyObject_IsTrue(value)) <= 0) {
        return truth;
    }
    if ((value = global(steps_globals, s__STEP_START)) == NULL) {
        return -1;
    }
    if (value == Py_None) {
        return 0; /* the first step: its start is made in Python */
    }
    if ((value = global(steps_globals, s__any_autocast)) == NULL) {
        return -1;
    }
    if (value == Py_None) {
        return 0; /* a torch without the one-call autocast query */
    }
    /* run_id() is None without a query: no run id shared, and not under torchrun */
    if ((value = global(dist_globals, s__run_id)) == NULL) {
        return -1;
    }
    if ((truth = PyObject_IsTrue(value)) != 0) {
        return truth < 0 ? -1 : 0;
    }
    if ((keys = global(dist_globals, s__ENV_KEYS)) == NULL
        || (value = global(dist_globals, s__RUN_ID_KEY)) == NULL) {
        PyErr_Clear(); /* _RUN_ID_KEY is not set where os.environ has no _data */
        return 0;
    }
    if (!PyDict_CheckExact(keys)) {
        return 0;
    }
#if PY_VERSION_HEX < 0x030C0000
    {   /* the environment's answer while its dict is unchanged (the dict's version tag) */
        static PyObject *seen_keys, *seen_key;
        static uint64_t seen_version;
        static int seen_absent;
        uint64_t version = ((PyDictObject *)keys)->ma_version_tag;
        if (keys == seen_keys && value == seen_key && version == seen_version) {
            return seen_absent;
        }
        if ((truth = PyDict_Contains(keys, value)) < 0) {
            return -1;
        }
        seen_keys = keys; /* compared by identity only: held by perfsdk.distributed */
        seen_key = value;
        seen_version = version;
        return seen_absent = !truth;
    }
#else
    truth = PyDict_Contains(keys, value);
    return truth < 0 ? -1 : !truth;
#endif
}

/* step_start(steps, samples, flops, implicit) -> Step: _step_python(...), compiled where it
 * can be. */
static PyObject *
fastpath_step_start(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *steps, *samples, *current, *value, *fn, *step, *index, *attrs, *region;
    int truth, fast;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "step_start(steps, samples, flops, implicit) takes 4 arguments");
        return NULL;
    }
    steps = args[0];
    samples = args[1];
    if ((fast = step_start_fast(steps, samples, args[2], &current)) < 0) {
        return NULL;
    }
    if (!fast) {
        if ((fn = global(steps_globals, s__step_python)) == NULL) {
            return NULL;
        }
        return PyObject_Vectorcall(fn, args, 4, NULL);
    }
    if ((truth = PyObject_IsTrue(args[3])) < 0) {
        return NULL;
    }
    if (!truth) {
        Py_XSETREF(STEPS_SLOT(steps, explicit_), Py_NewRef(Py_True));
    }
    if (current != Py_None) {
        Py_INCREF(current);
        if ((truth = step_end_fast(steps, current, Py_None)) > 0) {
            value = PyObject_CallMethodObjArgs(steps, s__end, current, Py_None, NULL);
            Py_XDECREF(value);
            truth = value == NULL ? -1 : 0;
        }
        Py_DECREF(current);
        if (truth < 0) {
            return NULL;
        }
    }
    if ((value = STEPS_SLOT(steps, indices)) == NULL) {
        PyErr_SetString(PyExc_AttributeError, "perfsdk: Steps._indices is unset");
        return NULL;
    }
    Py_INCREF(value); /* held across the call, as a lookup would have held it */
    index = PyIter_Next(value); /* two threads never get the same index */
    Py_DECREF(value);
    if (index == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "perfsdk: the step indices ran out");
        }
        return NULL;
    }
    if ((value = PyNumber_Add(index, int_one)) == NULL) {
        Py_DECREF(index);
        return NULL;
    }
    Py_XSETREF(STEPS_SLOT(steps, next_index), value);
    if ((step = step_type->tp_alloc(step_type, 0)) == NULL) {
        Py_DECREF(index);
        return NULL;
    }
    SLOT(step, step_slots.steps) = Py_NewRef(steps);
    SLOT(step, step_slots.index) = Py_NewRef(index);
    SLOT(step, step_slots.samples) = Py_NewRef(samples);
    SLOT(step, step_slots.flops) = Py_NewRef(Py_None);
    SLOT(step, step_slots.phase) = Py_NewRef(s_active_phase);
    SLOT(step, step_slots.region) = Py_NewRef(Py_None);
    Py_XSETREF(STEPS_SLOT(steps, current), Py_NewRef(step));
    if ((attrs = PyDict_New()) == NULL) {
        goto fail;
    }
    if (PyDict_SetItem(attrs, k_step, index) < 0
        || (samples != Py_None && PyDict_SetItem(attrs, k_samples, samples) < 0)) {
        goto fail_attrs;
    }
    /* autocast: one query without arguments in the common case (off) */
    if ((fn = global(steps_globals, s__any_autocast)) == NULL
        || (value = PyObject_CallNoArgs(fn)) == NULL) {
        goto fail_attrs;
    }
    truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (truth < 0) {
        goto fail_attrs;
    }
    if (truth) {
        if ((fn = global(steps_globals, s_autocast_dtype)) == NULL
            || (value = PyObject_CallNoArgs(fn)) == NULL) {
            goto fail_attrs;
        }
        truth = value == Py_None ? 0 : PyDict_SetItem(attrs, k_amp, value);
        Py_DECREF(value);
        if (truth < 0) {
            goto fail_attrs;
        }
    }
    if ((fn = global(steps_globals, s__STEP_START)) == NULL) {
        goto fail_attrs;
    }
    region = Py_TYPE(fn) == &RegionStartType ? rstart_call((RegionStartObject *)fn, attrs)
                                              : PyObject_CallOneArg(fn, attrs);
    Py_DECREF(attrs);
    if (region == NULL) {
        goto fail;
    }
    Py_SETREF(SLOT(step, step_slots.region), region);
    Py_DECREF(index);
    return step;
fail_attrs:
    Py_DECREF(attrs);
fail:
    Py_DECREF(index);
    Py_DECREF(step);
    return NULL;
}

/* bind_steps(perfsdk.auto.steps's globals, perfsdk.distributed's globals, Steps, Step): for
 * step_start and step_end (after bind_inner and bind_region). */
static PyObject *
fastpath_bind_steps(PyObject *module, PyObject *args)
{
    PyObject *globals, *dist, *exit_fn;
    PyTypeObject *steps_cls, *step_cls;
#define NAMES(X) X(k_step, "perfsdk.step") X(k_samples, "perfsdk.samples") \
    X(k_amp, "perfsdk.amp") X(k_samples_per_s, "perfsdk.samples_per_s") \
    X(s_active_phase, "active")
    if (!PyArg_ParseTuple(args, "O!O!O!O!:bind_steps", &PyDict_Type, &globals, &PyDict_Type,
                          &dist, &PyType_Type, &steps_cls, &PyType_Type, &step_cls)) {
        return NULL;
    }
    if (!full_bound || region_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind_steps: bind_region() was not called");
        return NULL;
    }
#define OFFSET(name, text) if ((step_slots.name = slot_offset(step_cls, text)) < 0) return NULL;
    OFFSET(steps, "_steps") OFFSET(flops, "flops") OFFSET(index, "index")
    OFFSET(phase, "phase") OFFSET(region, "region") OFFSET(samples, "samples")
#undef OFFSET
#define OFFSET(name, text) \
    if ((steps_slots.name = slot_offset(steps_cls, text)) < 0) return NULL;
    OFFSET(indices, "_indices") OFFSET(paused, "_paused") OFFSET(current, "current")
    OFFSET(explicit_, "explicit") OFFSET(listeners, "listeners") OFFSET(next_index, "next_index")
    OFFSET(schedule, "schedule")
#undef OFFSET
    if (step_cls->tp_alloc != PyType_GenericAlloc) {
        PyErr_SetString(PyExc_TypeError, "bind_steps: Step is not a plain class");
        return NULL;
    }
#define MAKE(var, text) if (var == NULL && (var = PyUnicode_InternFromString(text)) == NULL) \
    return NULL;
    NAMES(MAKE)
#undef MAKE
#undef NAMES
    if (int_one == NULL && (int_one = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    if ((exit_fn = PyObject_GetAttrString(module, "region_exit")) == NULL) {
        return NULL;
    }
    Py_XSETREF(region_exit_fn, exit_fn);
    Py_XSETREF(steps_globals, Py_NewRef(globals));
    Py_XSETREF(dist_globals, Py_NewRef(dist));
    Py_XSETREF(step_type, (PyTypeObject *)Py_NewRef(step_cls));
    Py_XSETREF(steps_type, (PyTypeObject *)Py_NewRef(steps_cls));
    Py_RETURN_NONE;
}

/* ---- TwinMethod: a method compiled for eager code, its Python twin for torch.compile ------
 *
 * TwinMethod(compiled, python) is a class attribute. An instance's lookup gives a bound method
 * (BoundTwin) that calls `compiled` (a method descriptor: no Python frame) and whose __func__
 * is `python`, the method's Python twin; the class's lookup gives `python`. Dynamo enters a
 * context manager made in the code it traces by inlining the __func__ of its bound __enter__
 * and __exit__, so it traces the Python twins, while eager code runs the compiled ones. */
typedef struct {
    PyObject_HEAD
    PyObject *compiled;
    PyObject *python;
} TwinMethodObject;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *twin; /* the TwinMethod */
    PyObject *self;
} BoundTwinObject;

static PyTypeObject BoundTwinType;

static PyObject *
bound_twin_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    BoundTwinObject *bound = (BoundTwinObject *)op;
    PyObject *compiled = ((TwinMethodObject *)bound->twin)->compiled, *stack[8], **all, *res;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), total;
    total = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    if (nargsf & PY_VECTORCALL_ARGUMENTS_OFFSET) { /* the slot before args is ours to use */
        PyObject **with_self = (PyObject **)args - 1, *saved = with_self[0];
        with_self[0] = bound->self;
        res = PyObject_Vectorcall(compiled, with_self, nargs + 1, kwnames);
        with_self[0] = saved;
        return res;
    }
    all = total < 8 ? stack : PyMem_New(PyObject *, (size_t)total + 1);
    if (all == NULL) {
        return PyErr_NoMemory();
    }
    all[0] = bound->self;
    if (total) {
        memcpy(all + 1, args, (size_t)total * sizeof(PyObject *));
    }
    res = PyObject_Vectorcall(compiled, all, nargs + 1, kwnames);
    if (all != stack) {
        PyMem_Free(all);
    }
    return res;
}

static PyObject *
bound_twin_func(PyObject *op, void *unused)
{
    return Py_NewRef(((TwinMethodObject *)((BoundTwinObject *)op)->twin)->python);
}

static PyObject *
bound_twin_self(PyObject *op, void *unused)
{
    return Py_NewRef(((BoundTwinObject *)op)->self);
}

static PyGetSetDef bound_twin_getset[] = {
    {"__func__", bound_twin_func, NULL, "The Python twin (what torch.compile traces).", NULL},
    {"__self__", bound_twin_self, NULL, "The instance.", NULL},
    {NULL},
};

static int
bound_twin_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((BoundTwinObject *)op)->twin);
    Py_VISIT(((BoundTwinObject *)op)->self);
    return 0;
}

static int
bound_twin_clear(PyObject *op)
{
    Py_CLEAR(((BoundTwinObject *)op)->twin);
    Py_CLEAR(((BoundTwinObject *)op)->self);
    return 0;
}

static void
bound_twin_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    bound_twin_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyTypeObject BoundTwinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.BoundTwin",
    .tp_doc = "A TwinMethod bound to an instance: calls the compiled method; __func__ is the "
              "Python twin.",
    .tp_basicsize = sizeof(BoundTwinObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(BoundTwinObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getset = bound_twin_getset,
    .tp_dealloc = bound_twin_dealloc,
    .tp_traverse = bound_twin_traverse,
    .tp_clear = bound_twin_clear,
};

static PyObject *
twin_get(PyObject *op, PyObject *obj, PyObject *type)
{
    BoundTwinObject *bound;
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(((TwinMethodObject *)op)->python);
    }
    if ((bound = PyObject_GC_New(BoundTwinObject, &BoundTwinType)) == NULL) {
        return NULL;
    }
    bound->vectorcall = bound_twin_vectorcall;
    bound->twin = Py_NewRef(op);
    bound->self = Py_NewRef(obj);
    PyObject_GC_Track(bound);
    return (PyObject *)bound;
}

static PyObject *
twin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *compiled, *python;
    TwinMethodObject *self;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)
        || !PyArg_ParseTuple(args, "OO:TwinMethod", &compiled, &python)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "TwinMethod(compiled, python) takes no keywords");
        }
        return NULL;
    }
    if (!PyCallable_Check(compiled) || !PyCallable_Check(python)) {
        PyErr_SetString(PyExc_TypeError, "TwinMethod: compiled and python must be callable");
        return NULL;
    }
    if ((self = (TwinMethodObject *)type->tp_alloc(type, 0)) == NULL) {
        return NULL;
    }
    self->compiled = Py_NewRef(compiled);
    self->python = Py_NewRef(python);
    return (PyObject *)self;
}

static int
twin_traverse(PyObject *op, visitproc visit, void *arg)
{
    Py_VISIT(((TwinMethodObject *)op)->compiled);
    Py_VISIT(((TwinMethodObject *)op)->python);
    return 0;
}

static int
twin_clear(PyObject *op)
{
    Py_CLEAR(((TwinMethodObject *)op)->compiled);
    Py_CLEAR(((TwinMethodObject *)op)->python);
    return 0;
}

static void
twin_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    twin_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyTypeObject TwinMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.TwinMethod",
    .tp_doc = "TwinMethod(compiled, python): a method that eager code calls compiled and "
              "torch.compile traces in Python.",
    .tp_basicsize = sizeof(TwinMethodObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = twin_new,
    .tp_descr_get = twin_get,
    .tp_dealloc = twin_dealloc,
    .tp_traverse = twin_traverse,
    .tp_clear = twin_clear,
};

/* Step.__enter__ and Step.__exit__, compiled (step_methods): the step itself, and
 * step_end(step._steps, step, exc). */
static PyObject *
step_method_enter(PyObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *
step_method_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *call[3];
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "Step.__exit__ takes 3 arguments");
        return NULL;
    }
    if ((call[0] = SLOT(self, step_slots.steps)) == NULL) {
        PyErr_SetString(PyExc_AttributeError, "perfsdk: the step has no steps");
        return NULL;
    }
    call[1] = self;
    call[2] = args[1];
    return fastpath_step_end(NULL, call, 3);
}

static PyMethodDef step_method_defs[] = {
    {"__enter__", step_method_enter, METH_NOARGS, "The step (compiled)."},
    {"__exit__", (PyCFunction)(void (*)(void))step_method_exit, METH_FASTCALL,
     "End the step (compiled)."},
};

/* step_methods() -> (__enter__, __exit__): Step's compiled methods (method descriptors; after
 * bind_steps), for TwinMethod. */
static PyObject *
fastpath_step_methods(PyObject *module, PyObject *unused)
{
    if (step_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "step_methods: bind_steps() was not called");
        return NULL;
    }
    return method_pair(step_type, step_method_defs);
}

/* NodeHook(seq, entries): the backward pre-hook of one hooked node (perfsdk/auto/backward.py,
 * _on_node(seq, entries, grad), compiled). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *seq;
    PyObject *entries;
} NodeHookObject;

enum { E_OPEN, E_FIRST, E_REGION, E_TASK, E_END, E_SIZE };

/* Close the top entries of `stack` whose FIRST is above seq, or that are finished. */
static int
close_above(PyObject *stack, PyObject *seq)
{
    while (PyList_GET_SIZE(stack) > 0) {
        PyObject *entry = PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1), *region, *res;
        int above;
        if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != E_SIZE) {
            PyErr_SetString(PyExc_TypeError, "perfsdk: a backward entry is malformed");
            return -1;
        }
        above = PyObject_RichCompareBool(PyList_GET_ITEM(entry, E_FIRST), seq, Py_GT);
        if (above == 0) {
            above = PyObject_RichCompareBool(PyList_GET_ITEM(entry, E_TASK), int_done, Py_EQ);
        }
        if (above <= 0) {
            return above;
        }
        entry = list_pop_last(stack); /* the entry read above */
        region = PyList_GET_ITEM(entry, E_REGION);
        Py_INCREF(region);
        Py_INCREF(Py_None);
        PyList_SetItem(entry, E_REGION, Py_None);  /* steals; cannot fail: index in range */
        {   /* region.exit(None, entry[END]); no ARGUMENTS_OFFSET: call[-1] is not ours */
            PyObject *call[3] = {region, Py_None, PyList_GET_ITEM(entry, E_END)};
            res = PyObject_VectorcallMethod(s_exit, call, 3, NULL);
        }
        Py_DECREF(region);
        Py_DECREF(entry);
        if (res == NULL) {
            return -1;
        }
        Py_DECREF(res);
    }
    return 0;
}

static int
node_hook_run(NodeHookObject *self)
{
    PyObject *tls, *stack = NULL, *entries = self->entries, *task = NULL, *region;
    Py_ssize_t i;
    int status = -1;
    if ((tls = global(backward_globals, s__tls)) == NULL
        || (stack = PyObject_GetAttr(tls, s_stack)) == NULL) {
        return -1;
    }
    if (!PyList_CheckExact(stack) || !PyList_CheckExact(entries)) {
        PyErr_SetString(PyExc_TypeError, "perfsdk: backward state is malformed");
        goto done;
    }
    if (close_above(stack, self->seq) < 0) {
        goto done;
    }
    for (i = 0; i < PyList_GET_SIZE(entries); i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i), *fn, *current;
        int same;
        if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != E_SIZE) {
            PyErr_SetString(PyExc_TypeError, "perfsdk: a backward entry is malformed");
            goto done;
        }
        if (PyList_GET_ITEM(entry, E_REGION) != Py_None) { /* opened by another output */
            continue;
        }
        Py_INCREF(entry);
        Py_XDECREF(task);
        if ((fn = global(backward_globals, s__task_id)) == NULL
            || (task = PyObject_CallNoArgs(fn)) == NULL
            || (current = PyObject_GetAttr(tls, s_task)) == NULL) {
            Py_DECREF(entry);
            goto done;
        }
        same = PyObject_RichCompareBool(current, task, Py_EQ);
        Py_DECREF(current);
        if (same < 0) {
            Py_DECREF(entry);
            goto done;
        }
        if (!same) { /* the first region this pass opens on this thread */
            PyObject *queue_cb, *partial, *end_of_pass, *cb, *res;
            if ((queue_cb = global(backward_globals, s__queue_callback)) == NULL
                || (partial = global(backward_globals, s__partial)) == NULL
                || (end_of_pass = global(backward_globals, s__end_of_pass)) == NULL) {
                Py_DECREF(entry);
                goto done;
            }
            {
                PyObject *pargs[2] = {end_of_pass, stack};
                cb = PyObject_Vectorcall(partial, pargs, 2, NULL);
            }
            res = cb == NULL ? NULL : PyObject_CallOneArg(queue_cb, cb);
            Py_XDECREF(cb);
            if (res == NULL || PyObject_SetAttr(tls, s_task, task) < 0) {
                Py_XDECREF(res);
                Py_DECREF(entry);
                goto done;
            }
            Py_DECREF(res);
        }
        {
            PyObject *gate = PyList_GET_ITEM(entry, E_OPEN);
            region = Py_TYPE(gate) == &InnerGateType ? gate_open((InnerGateObject *)gate)
                                                     : PyObject_CallNoArgs(gate);
        }
        if (region == NULL) {
            Py_DECREF(entry);
            goto done;
        }
        if (region == null_region) {
            Py_DECREF(region);
            Py_DECREF(entry);
            continue;
        }
        PyList_SetItem(entry, E_REGION, region); /* steal */
        Py_INCREF(task);
        PyList_SetItem(entry, E_TASK, task);
        PyList_SetItem(entry, E_END, PyLong_FromLong(0));
        if (PyList_GET_ITEM(entry, E_END) == NULL || PyList_Append(stack, entry) < 0) {
            Py_DECREF(entry);
            goto done;
        }
        Py_DECREF(entry);
    }
    status = 0;
done:
    Py_XDECREF(task);
    Py_XDECREF(stack);
    return status;
}

static PyObject *
node_hook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    NodeHookObject *self = (NodeHookObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "NodeHook takes one argument (the gradients)");
        return NULL;
    }
    if (backward_globals == NULL || region_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "perfsdk._fastpath: NodeHook is not bound");
        return NULL;
    }
    if (node_hook_run(self) < 0) { /* our bookkeeping must never break the user's backward */
        PyObject *type, *value, *traceback, *warn, *res;
        PyErr_Fetch(&type, &value, &traceback);
        if (!PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
            PyErr_Restore(type, value, traceback); /* KeyboardInterrupt and the like */
            return NULL;
        }
        PyErr_NormalizeException(&type, &value, &traceback);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        warn = PyDict_GetItemWithError(backward_globals, s__warn);
        res = warn == NULL ? NULL : PyObject_CallOneArg(warn, value);
        Py_XDECREF(value);
        if (res == NULL) {
            PyErr_WriteUnraisable(op);
        }
        Py_XDECREF(res);
    }
    Py_RETURN_NONE;
}

static PyObject *
node_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *seq, *entries;
    NodeHookObject *self;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "NodeHook takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O!:NodeHook", &PyLong_Type, &seq, &PyList_Type, &entries)) {
        return NULL;
    }
    self = (NodeHookObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = node_hook_vectorcall;
    self->seq = Py_NewRef(seq);
    self->entries = Py_NewRef(entries);
    return (PyObject *)self;
}

static int
node_hook_traverse(PyObject *op, visitproc visit, void *arg)
{
    NodeHookObject *self = (NodeHookObject *)op;
    Py_VISIT(self->seq);
    Py_VISIT(self->entries);
    return 0;
}

static int
node_hook_clear(PyObject *op)
{
    NodeHookObject *self = (NodeHookObject *)op;
    Py_CLEAR(self->seq);
    Py_CLEAR(self->entries);
    return 0;
}

static void
node_hook_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    node_hook_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
node_hook_repr(PyObject *op)
{
    NodeHookObject *self = (NodeHookObject *)op;
    return PyUnicode_FromFormat("<perfsdk._fastpath.NodeHook seq=%R, %zd entries>", self->seq,
                                PyList_GET_SIZE(self->entries));
}

static PyTypeObject NodeHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.NodeHook",
    .tp_doc = "NodeHook(seq, entries): hook(grad) is perfsdk.auto.backward._on_node(seq, "
              "entries, grad), compiled.",
    .tp_basicsize = sizeof(NodeHookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(NodeHookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = node_hook_new,
    .tp_dealloc = node_hook_dealloc,
    .tp_traverse = node_hook_traverse,
    .tp_clear = node_hook_clear,
    .tp_repr = node_hook_repr,
};

static PyObject *
node_hook_make(PyObject *seq, PyObject *entries)
{
    NodeHookObject *self = PyObject_GC_New(NodeHookObject, &NodeHookType);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = node_hook_vectorcall;
    self->seq = Py_NewRef(seq);
    self->entries = Py_NewRef(entries);
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* Hook `node` (the grad_fn of `tensor`) for a new list of entries holding `entry`:
 * _register_output's body (the tensor's _backward_hooks, else a node pre-hook). */
static int
hook_output(PyObject *tensor, PyObject *node, PyObject *seq, PyObject *entry, PyObject *nodes)
{
    PyObject *entries, *make, *hook, *hooks, *res;
    int status = -1;
    if ((entries = PyList_New(1)) == NULL) {
        return -1;
    }
    PyList_SET_ITEM(entries, 0, Py_NewRef(entry));
    if (PyDict_SetItem(nodes, node, entries) < 0
        || (make = global(backward_globals, s__make_hook)) == NULL) {
        Py_DECREF(entries);
        return -1;
    }
    if (make == (PyObject *)&NodeHookType) {
        hook = node_hook_make(seq, entries);
    } else { /* a test counting registrations */
        PyObject *args[2] = {seq, entries};
        hook = PyObject_Vectorcall(make, args, 2, NULL);
    }
    Py_DECREF(entries);
    if (hook == NULL || (hooks = PyObject_GetAttr(tensor, s__backward_hooks)) == NULL) {
        Py_XDECREF(hook);
        return -1;
    }
    Py_DECREF(hooks);
    if (hooks == Py_None) { /* tensor._backward_hooks = _Hooks(((_HOOK_KEY, hook),)) */
        PyObject *cls = global(backward_globals, s__Hooks);
        PyObject *key = cls == NULL ? NULL : global(backward_globals, s__HOOK_KEY);
        hooks = key == NULL ? NULL : PyObject_CallNoArgs(cls);  /* then one item: no tuples */
        if (hooks != NULL && !PyDict_Check(hooks)) {
            PyErr_SetString(PyExc_TypeError, "perfsdk: _Hooks is not a dict");
            Py_CLEAR(hooks);
        }
        if (hooks == NULL || PyDict_SetItem(hooks, key, hook) < 0
            || PyObject_SetAttr(tensor, s__backward_hooks, hooks) < 0) {
            Py_XDECREF(hooks);
            goto done;
        }
        Py_DECREF(hooks);
        res = PyObject_CallMethodOneArg(node, s__register_hook_dict, tensor);
    } else {
        res = PyObject_CallMethodOneArg(node, s_register_prehook, hook);
    }
    if (res != NULL) {
        Py_DECREF(res);
        status = 0;
    }
done:
    Py_DECREF(hook);
    return status;
}

/* track(open_, first, inputs, output): perfsdk.auto.backward.track, compiled for an output
 * that is a plain torch.Tensor; any other output goes to the Python twin (track_python). */
static PyObject *
fastpath_track(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *open_, *first, *inputs, *output, *tensor_type, *node, *seq = NULL, *entry = NULL;
    PyObject *tls, *nodes = NULL, *entries, *result = NULL;
    int above;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "track(open_, first, inputs, output)");
        return NULL;
    }
    if (backward_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "perfsdk._fastpath: bind_backward() was not called");
        return NULL;
    }
    open_ = args[0];
    first = args[1];
    inputs = args[2];
    output = args[3];
    if ((tensor_type = global(backward_globals, s__Tensor)) == NULL) {
        return NULL;
    }
    if ((PyObject *)Py_TYPE(output) != tensor_type) {
        PyObject *python = global(backward_globals, s_track_python);
        return python == NULL ? NULL : PyObject_Vectorcall(python, args, 4, NULL);
    }
    if ((node = PyObject_GetAttr(output, s_grad_fn)) == NULL) {
        return NULL;
    }
    if (node == Py_None) {
        Py_DECREF(node);
        Py_RETURN_FALSE;
    }
    if ((seq = PyObject_CallMethodNoArgs(node, s__sequence_nr)) == NULL
        || (above = PyObject_RichCompareBool(seq, first, Py_GE)) < 0) {
        goto done;
    }
    if (!above) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    if ((tls = global(backward_globals, s__tls)) == NULL
        || (nodes = PyObject_GetAttr(tls, s_nodes)) == NULL) {
        goto done;
    }
    if (!PyDict_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "perfsdk: backward state is malformed");
        goto done;
    }
    /* entry = [open_, first, None, None, 0] */
    if ((entry = PyList_New(5)) == NULL) {
        goto done;
    }
    PyList_SET_ITEM(entry, E_OPEN, Py_NewRef(open_));
    PyList_SET_ITEM(entry, E_FIRST, Py_NewRef(first));
    PyList_SET_ITEM(entry, E_REGION, Py_NewRef(Py_None));
    PyList_SET_ITEM(entry, E_TASK, Py_NewRef(Py_None));
    PyList_SET_ITEM(entry, E_END, PyLong_FromLong(0));
    if (PyList_GET_ITEM(entry, E_END) == NULL) {
        goto done;
    }
    if ((entries = PyDict_GetItemWithError(nodes, node)) != NULL) {
        /* hooked last, the outermost call: it opens first */
        if (!PyList_Check(entries) || PyList_Insert(entries, 0, entry) < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "perfsdk: backward state is malformed");
            }
            goto done;
        }
    } else if (PyErr_Occurred() || hook_output(output, node, seq, entry, nodes) < 0) {
        goto done;
    }
    /* the inputs' grad_fn: where this call's backward ends (_register; rare past the first) */
    if (inputs != Py_None) {
        int known = PyList_CheckExact(inputs) ? 0 : PyDict_Contains(nodes, inputs);
        if (known < 0) {
            goto done;
        }
        if (!known) {
            PyObject *register_ = global(backward_globals, s__register), *res;
            if (register_ == NULL) {
                goto done;
            }
            if (PyList_CheckExact(inputs)) {
                Py_ssize_t i;
                for (i = 0; i < PyList_GET_SIZE(inputs); i++) {
                    PyObject *input = PyList_GET_ITEM(inputs, i), *call[2];
                    if (input == Py_None || (known = PyDict_Contains(nodes, input)) > 0) {
                        continue;
                    }
                    call[0] = input;
                    call[1] = nodes;
                    if (known < 0
                        || (res = PyObject_Vectorcall(register_, call, 2, NULL)) == NULL) {
                        goto done;
                    }
                    Py_DECREF(res);
                }
            } else {
                PyObject *call[2] = {inputs, nodes};
                if ((res = PyObject_Vectorcall(register_, call, 2, NULL)) == NULL) {
                    goto done;
                }
                Py_DECREF(res);
            }
        }
    }
    result = Py_NewRef(Py_True);
done:
    Py_DECREF(node);
    Py_XDECREF(seq);
    Py_XDECREF(entry);
    Py_XDECREF(nodes);
    return result;
}

/* ModuleCall(probe, inner): the body of an instrumented module's forward wrapper
 * (perfsdk/auto/module.py, _wrapped_forward's forward past its torch.compile check), called as
 * call(module, args, kwargs). The Python wrapper keeps only what dynamo must see (the compile
 * check); the rest runs here, statement for statement the Python wrapper's, with one
 * difference: the count of instrumented calls open on this thread (module.py's _tls.depth) is a
 * C thread-local, where a threading.local attribute costs about 250 instructions a read or
 * write. The globals come from perfsdk.auto.module (bind_module). */
static PyObject *module_globals; /* perfsdk.auto.module's module dict (bind_module) */
static _Thread_local Py_ssize_t module_depth;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *probe;
    PyObject *spec;
    PyObject *open;       /* probe.open (an InnerGate, or any callable) */
    PyObject *bwd;        /* probe.bwd_open, or None */
    PyObject *enter_root; /* probe.enter_root for the model itself, else NULL */
    PyObject *inner;      /* an instance forward that was there before, else NULL */
    Py_ssize_t live;      /* the offset of probe.live */
} ModuleCallObject;

/* The module's own forward: inner(*args, **kwargs), else type(module).forward(module, ...). */
static PyObject *
module_call_inner(ModuleCallObject *self, PyObject *module, PyObject *args, PyObject *kwargs)
{
    PyObject *fn, *result, *stack[9];
    Py_ssize_t i, n = PyTuple_GET_SIZE(args);
    if (self->inner != NULL) {
        return PyObject_Call(self->inner, args, kwargs);
    }
    if ((fn = PyObject_GetAttr((PyObject *)Py_TYPE(module), s_forward)) == NULL) {
        return NULL;
    }
    if (kwargs == NULL && n < 9) {
        stack[0] = module;
        for (i = 0; i < n; i++) {
            stack[i + 1] = PyTuple_GET_ITEM(args, i);
        }
        result = PyObject_Vectorcall(fn, stack, n + 1, NULL);
    } else {
        PyObject *all = PyTuple_New(n + 1);
        if (all == NULL) {
            Py_DECREF(fn);
            return NULL;
        }
        PyTuple_SET_ITEM(all, 0, Py_NewRef(module));
        for (i = 0; i < n; i++) {
            PyTuple_SET_ITEM(all, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
        }
        result = PyObject_Call(fn, all, kwargs);
        Py_DECREF(all);
    }
    Py_DECREF(fn);
    return result;
}

/* _no_backward(spec, exc) for the exception set now, when it is an Exception (0: handled);
 * any other (KeyboardInterrupt) stays set (-1). */
static int
module_no_backward(ModuleCallObject *self)
{
    PyObject *type, *value, *traceback, *fn, *res;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    fn = global(module_globals, s__no_backward);
    if (fn != NULL) {
        PyObject *call[2] = {self->spec, value};
        res = PyObject_Vectorcall(fn, call, 2, NULL);
    } else {
        res = NULL;
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    if (res == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
}

/* The outermost tracked call on this thread returned: _forward_done(). */
static int
module_leave(void)
{
    PyObject *fn, *res;
    if (--module_depth > 0) {
        return 0;
    }
    module_depth = 0;
    if ((fn = global(module_globals, s__forward_done)) == NULL
        || (res = PyObject_CallNoArgs(fn)) == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
}

/* module_leave() while the call's own exception is set: that exception stays the one raised. */
static void
module_leave_raising(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (module_leave() < 0) {
        PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
}

static PyObject *
module_call_run(ModuleCallObject *self, PyObject *module, PyObject *args, PyObject *kwargs)
{
    PyObject *state, *value, *region, *first = NULL, *inputs = NULL, *output, *fn;
    int truth;
    if ((state = global(region_globals, s__state)) == NULL) {
        return NULL;
    }
    value = Py_TYPE(state) == state_slots.type ? SLOT(state, state_slots.enabled)
                                                : PyObject_GetAttr(state, s_enabled);
    if (value == NULL || (truth = PyObject_IsTrue(value)) < 0) {
        if (Py_TYPE(state) != state_slots.type) {
            Py_XDECREF(value);
        }
        return NULL;
    }
    if (Py_TYPE(state) != state_slots.type) {
        Py_DECREF(value);
    }
    if (truth && ((value = SLOT(self->probe, self->live)) == NULL
                  || (truth = PyObject_IsTrue(value)) < 0)) {
        if (value == NULL) {
            PyErr_SetString(PyExc_AttributeError, "perfsdk: the probe has no 'live'");
        }
        return NULL;
    }
    if (!truth) {
        return module_call_inner(self, module, args, kwargs);
    }
    if (self->enter_root != NULL) {
        region = PyObject_CallNoArgs(self->enter_root);
    } else if (Py_TYPE(self->open) == &InnerGateType) {
        region = gate_open((InnerGateObject *)self->open);
    } else {
        region = PyObject_CallNoArgs(self->open);
    }
    if (region == NULL) {
        return NULL;
    }
    if (self->bwd != Py_None && region != null_region) {
        PyObject *tensor_type, *grad;
        if ((fn = global(module_globals, s__grad_enabled)) == NULL
            || (grad = PyObject_CallNoArgs(fn)) == NULL) {
            Py_DECREF(region);
            return NULL;
        }
        truth = grad == Py_True;
        Py_DECREF(grad);
        if (truth) { /* where this call's backward starts and ends (perfsdk.auto.backward) */
            int single = 0;
            if ((tensor_type = global(module_globals, s__Tensor)) == NULL) {
                goto bookkeeping;
            }
            if (kwargs == NULL && PyTuple_GET_SIZE(args) == 1
                && (single = PyObject_IsInstance(PyTuple_GET_ITEM(args, 0), tensor_type)) < 0) {
                goto bookkeeping;
            }
            if (single) {
                inputs = PyObject_GetAttr(PyTuple_GET_ITEM(args, 0), s_grad_fn);
            } else if ((fn = global(module_globals, s__input_nodes)) != NULL) {
                PyObject *call[2] = {args, kwargs == NULL ? PyDict_New() : Py_NewRef(kwargs)};
                inputs = call[1] == NULL ? NULL : PyObject_Vectorcall(fn, call, 2, NULL);
                Py_XDECREF(call[1]);
            }
            if (inputs != NULL && (fn = global(module_globals, s__first_node)) != NULL) {
                first = PyObject_CallNoArgs(fn);
            }
        bookkeeping:
            if (first == NULL) {
                Py_CLEAR(inputs);
                if (module_no_backward(self) < 0) {
                    Py_DECREF(region);
                    return NULL;
                }
            } else {
                module_depth++;
            }
        }
    }
    output = module_call_inner(self, module, args, kwargs);
    if (output == NULL) { /* region.exit(exc), _leave(first), raise */
        PyObject *type, *exc, *traceback, *res;
        PyErr_Fetch(&type, &exc, &traceback);
        PyErr_NormalizeException(&type, &exc, &traceback);
        if (traceback != NULL) {
            PyException_SetTraceback(exc, traceback);
        }
        res = PyObject_CallMethodOneArg(region, s_exit, exc);
        if (res == NULL) { /* exit's own error replaces the call's, as in Python */
            Py_XDECREF(type);
            Py_XDECREF(exc);
            Py_XDECREF(traceback);
        } else {
            Py_DECREF(res);
            PyErr_Restore(type, exc, traceback);
        }
        if (first != NULL) {
            module_leave_raising();
        }
        Py_DECREF(region);
        Py_XDECREF(first);
        Py_XDECREF(inputs);
        return NULL;
    }
    {
        PyObject *res = PyObject_CallMethodOneArg(region, s_exit, Py_None);
        Py_DECREF(region);
        if (res == NULL) { /* the call is over all the same: its count too */
            if (first != NULL) {
                module_leave_raising();
            }
            Py_XDECREF(first);
            Py_XDECREF(inputs);
            Py_DECREF(output);
            return NULL;
        }
        Py_DECREF(res);
    }
    if (first != NULL) {
        PyObject *call[4] = {self->bwd, first, inputs, output}, *res;
        res = fastpath_track(NULL, call, 4);
        Py_DECREF(first);
        Py_DECREF(inputs);
        if (res == NULL && module_no_backward(self) < 0) {
            module_depth--; /* a KeyboardInterrupt: the call is over all the same */
            Py_DECREF(output);
            return NULL;
        }
        Py_XDECREF(res);
        if (module_leave() < 0) {
            Py_DECREF(output);
            return NULL;
        }
    }
    return output;
}

static PyObject *
module_call_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *kwargs;
    if (PyVectorcall_NARGS(nargsf) != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))
        || !PyTuple_Check(args[1]) || (args[2] != Py_None && !PyDict_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "ModuleCall takes (module, args: tuple, kwargs: dict)");
        return NULL;
    }
    if (module_globals == NULL || region_globals == NULL || backward_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "perfsdk._fastpath: ModuleCall is not bound");
        return NULL;
    }
    kwargs = args[2] == Py_None || PyDict_GET_SIZE(args[2]) == 0 ? NULL : args[2];
    return module_call_run((ModuleCallObject *)op, args[0], args[1], kwargs);
}

static PyObject *
module_call_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *probe, *inner, *root;
    ModuleCallObject *self;
    int is_root;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) { /* public API: 3.13 hid the helper */
        PyErr_SetString(PyExc_TypeError, "ModuleCall() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO:ModuleCall", &probe, &inner)) {
        return NULL;
    }
    if ((self = (ModuleCallObject *)type->tp_alloc(type, 0)) == NULL) {
        return NULL;
    }
    self->vectorcall = module_call_vectorcall;
    self->probe = Py_NewRef(probe);
    self->inner = inner == Py_None ? NULL : Py_NewRef(inner);
    if ((self->live = slot_offset(Py_TYPE(probe), "live")) < 0
        || (self->spec = PyObject_GetAttrString(probe, "spec")) == NULL
        || (self->open = PyObject_GetAttrString(probe, "open")) == NULL
        || (self->bwd = PyObject_GetAttrString(probe, "bwd_open")) == NULL
        || (root = PyObject_GetAttrString(probe, "root")) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    is_root = PyObject_IsTrue(root);
    Py_DECREF(root);
    if (is_root < 0
        || (is_root && (self->enter_root = PyObject_GetAttrString(probe, "enter_root")) == NULL)) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
module_call_traverse(PyObject *op, visitproc visit, void *arg)
{
    ModuleCallObject *self = (ModuleCallObject *)op;
    Py_VISIT(self->probe);
    Py_VISIT(self->spec);
    Py_VISIT(self->open);
    Py_VISIT(self->bwd);
    Py_VISIT(self->enter_root);
    Py_VISIT(self->inner);
    return 0;
}

static int
module_call_clear(PyObject *op)
{
    ModuleCallObject *self = (ModuleCallObject *)op;
    Py_CLEAR(self->probe);
    Py_CLEAR(self->spec);
    Py_CLEAR(self->open);
    Py_CLEAR(self->bwd);
    Py_CLEAR(self->enter_root);
    Py_CLEAR(self->inner);
    return 0;
}

static void
module_call_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    module_call_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *
module_call_repr(PyObject *op)
{
    ModuleCallObject *self = (ModuleCallObject *)op;
    return self->spec == NULL ? PyUnicode_FromString("<ModuleCall>")
                              : PyUnicode_FromFormat("<ModuleCall of %R>", self->spec);
}

static PyTypeObject ModuleCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.ModuleCall",
    .tp_basicsize = sizeof(ModuleCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ModuleCall(probe, inner)(module, args, kwargs): the body of an instrumented "
              "module's forward wrapper (perfsdk.auto.module), compiled.",
    .tp_vectorcall_offset = offsetof(ModuleCallObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = module_call_new,
    .tp_traverse = module_call_traverse,
    .tp_clear = module_call_clear,
    .tp_dealloc = module_call_dealloc,
    .tp_repr = module_call_repr,
};

/* bind_module(globals): perfsdk.auto.module's module dict, for ModuleCall. */
static PyObject *
fastpath_bind_module(PyObject *module, PyObject *globals)
{
    if (!PyDict_Check(globals)) {
        PyErr_SetString(PyExc_TypeError, "bind_module: expects a module's globals dict");
        return NULL;
    }
    Py_XSETREF(module_globals, Py_NewRef(globals));
    Py_RETURN_NONE;
}

/* bind_backward(globals): perfsdk.auto.backward's module dict, for NodeHook. */
static PyObject *
fastpath_bind_backward(PyObject *module, PyObject *globals)
{
    if (!PyDict_Check(globals)) {
        PyErr_SetString(PyExc_TypeError, "bind_backward: expects a module's globals dict");
        return NULL;
    }
    Py_XSETREF(backward_globals, Py_NewRef(globals));
    Py_RETURN_NONE;
}

/* host_times(records, SPEC, T0, T1, DEVICE_MS, ERROR, ATTRS, keys) -> (times, more): the
 * summary's pass over a chunk of region records (perfsdk/export/summary.py: _host_times_python,
 * its twin). times: {spec index: [host ms, ...]} in the records' order, each (T1 - T0) / 1e6 as
 * Python computes it (an exact int difference, then one correctly rounded division); more: the
 * records with a device time, an error, or attributes holding one of keys (a tuple of str), in
 * order. Records must be tuples long enough. */
static PyObject *
fastpath_host_times(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[6], need = 0;
    if (nargs != 8 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[7])) {
        PyErr_SetString(PyExc_TypeError, "host_times(records: list, SPEC, T0, T1, DEVICE_MS, "
                        "ERROR, ATTRS, keys: tuple)");
        return NULL;
    }
    for (int i = 0; i < 6; i++) {
        at[i] = PyLong_AsSsize_t(args[i + 1]);
        if (at[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (at[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "host_times: field indexes must be >= 0");
            return NULL;
        }
        if (at[i] >= need) {
            need = at[i] + 1;
        }
    }
    PyObject *records = args[0], *keys = args[7];
    PyObject *times = PyDict_New();
    PyObject *more = PyList_New(0);
    PyObject *last_spec = NULL, *last_list = NULL; /* borrowed: consecutive records of a spec */
    if (times == NULL || more == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        if (!PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) < need) {
            PyErr_Format(PyExc_TypeError, "host_times: record %zd is not a region record", i);
            goto fail;
        }
        PyObject *spec = PyTuple_GET_ITEM(rec, at[0]);
        long long t0 = PyLong_AsLongLong(PyTuple_GET_ITEM(rec, at[1]));
        long long t1 = PyLong_AsLongLong(PyTuple_GET_ITEM(rec, at[2]));
        if ((t0 == -1 || t1 == -1) && PyErr_Occurred()) {
            goto fail;
        }
        PyObject *list = last_list;
        if (spec != last_spec) {
            list = PyDict_GetItemWithError(times, spec);
            if (list == NULL) {
                if (PyErr_Occurred() || (list = PyList_New(0)) == NULL) {
                    goto fail;
                }
                int set = PyDict_SetItem(times, spec, list);
                Py_DECREF(list); /* the dict holds it */
                if (set < 0) {
                    goto fail;
                }
            }
            last_spec = spec;
            last_list = list;
        }
        PyObject *ms = PyFloat_FromDouble((double)(t1 - t0) / 1e6);
        if (ms == NULL) {
            goto fail;
        }
        int appended = PyList_Append(list, ms);
        Py_DECREF(ms);
        if (appended < 0) {
            goto fail;
        }
        int wanted = PyTuple_GET_ITEM(rec, at[3]) != Py_None
                     || PyTuple_GET_ITEM(rec, at[4]) != Py_None;
        PyObject *attrs = PyTuple_GET_ITEM(rec, at[5]);
        if (!wanted && attrs != Py_None) {
            if (!PyDict_Check(attrs)) {
                PyErr_Format(PyExc_TypeError, "host_times: record %zd's attributes are not a "
                             "dict", i);
                goto fail;
            }
            for (Py_ssize_t k = 0; !wanted && k < PyTuple_GET_SIZE(keys); k++) {
                wanted = PyDict_Contains(attrs, PyTuple_GET_ITEM(keys, k));
                if (wanted < 0) {
                    goto fail;
                }
            }
        }
        if (wanted && PyList_Append(more, rec) < 0) {
            goto fail;
        }
    }
    PyObject *out = PyTuple_Pack(2, times, more);
    Py_DECREF(times);
    Py_DECREF(more);
    return out;
fail:
    Py_XDECREF(times);
    Py_XDECREF(more);
    return NULL;
}

static PyObject *
fastpath_maxrss(PyObject *module, PyObject *unused)
{
    struct rusage usage;
#if defined(RUSAGE_THREAD)
    if (getrusage(RUSAGE_THREAD, &usage) != 0)
#else
    if (getrusage(RUSAGE_SELF, &usage) != 0)
#endif
    {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
#if defined(__APPLE__)
    return PyLong_FromLongLong((long long)usage.ru_maxrss); /* bytes on macOS */
#else
    return PyLong_FromLongLong((long long)usage.ru_maxrss * 1024); /* KiB elsewhere */
#endif
}

/* RssPeak(reuse_ns): the peak-RSS readings of memory=True regions on the host (perfsdk/memory.py:
 * _RssPeakPython is its twin). baseline() is a region's enter: the latest reading when it began
 * at most reuse_ns earlier, else a new one; read() takes a reading now (an exit, or the baseline
 * of a region on the GPU); host_exit(rss0) is a host region's exit, the memory tuple
 * (None, None, None, rss1 - rss0, rss1). The clock is CLOCK_MONOTONIC (what perf_counter_ns
 * reads on Linux); it only ever compares its own readings. */
typedef struct {
    PyObject_HEAD
    long long value; /* the latest reading, bytes */
    long long when;  /* when it began, ns */
    long long reuse_ns;
} RssPeakObject;

#define RSS_NEVER (-(1LL << 62))

static int
rss_now(long long *now, long long *value)
{
    struct timespec ts;
    struct rusage usage;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
#if defined(RUSAGE_THREAD)
    if (getrusage(RUSAGE_THREAD, &usage) != 0)
#else
    if (getrusage(RUSAGE_SELF, &usage) != 0)
#endif
    {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
#if defined(__APPLE__)
    *value = (long long)usage.ru_maxrss;
#else
    *value = (long long)usage.ru_maxrss * 1024;
#endif
    return 0;
}

static int
rsspeak_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    RssPeakObject *self = (RssPeakObject *)op;
    static char *kwlist[] = {"reuse_ns", NULL};
    long long reuse_ns;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L:RssPeak", kwlist, &reuse_ns)) {
        return -1;
    }
    self->reuse_ns = reuse_ns;
    self->value = 0;
    self->when = RSS_NEVER;
    return 0;
}

static PyObject *
rsspeak_read(PyObject *op, PyObject *unused)
{
    RssPeakObject *self = (RssPeakObject *)op;
    long long now, value;
    if (rss_now(&now, &value) < 0) {
        return NULL;
    }
    self->value = value;
    self->when = now;
    return PyLong_FromLongLong(value);
}

static PyObject *
rsspeak_baseline(PyObject *op, PyObject *unused)
{
    RssPeakObject *self = (RssPeakObject *)op;
    struct timespec ts;
    long long now;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (now - self->when > self->reuse_ns) {
        return rsspeak_read(op, NULL);
    }
    return PyLong_FromLongLong(self->value);
}

static PyObject *
rsspeak_host_exit(PyObject *op, PyObject *rss0)
{
    RssPeakObject *self = (RssPeakObject *)op;
    long long now, value, before;
    PyObject *delta, *peak, *result;
    before = PyLong_AsLongLong(rss0);
    if (before == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (rss_now(&now, &value) < 0) {
        return NULL;
    }
    self->value = value;
    self->when = now;
    result = PyTuple_New(5);
    if (result == NULL) {
        return NULL;
    }
    delta = PyLong_FromLongLong(value - before);
    peak = delta == NULL ? NULL : PyLong_FromLongLong(value);
    if (peak == NULL) {
        Py_XDECREF(delta);
        Py_DECREF(result);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(result, 1, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(result, 2, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(result, 3, delta);
    PyTuple_SET_ITEM(result, 4, peak);
    return result;
}

static PyObject *
rsspeak_reset(PyObject *op, PyObject *unused)
{
    RssPeakObject *self = (RssPeakObject *)op;
    self->value = 0;
    self->when = RSS_NEVER;
    Py_RETURN_NONE;
}

static PyObject *
rsspeak_get_last(PyObject *op, void *closure)
{
    RssPeakObject *self = (RssPeakObject *)op;
    return Py_BuildValue("(LL)", self->value, self->when);
}

static PyMethodDef rsspeak_methods[] = {
    {"baseline", rsspeak_baseline, METH_NOARGS,
     "baseline() -> int: a region's peak-RSS baseline (the latest reading if it began at most "
     "reuse_ns ago, else a new one)."},
    {"read", rsspeak_read, METH_NOARGS, "read() -> int: a peak-RSS reading now, kept."},
    {"host_exit", rsspeak_host_exit, METH_O,
     "host_exit(rss0) -> (None, None, None, rss1 - rss0, rss1): a host region's exit."},
    {"reset", rsspeak_reset, METH_NOARGS, "reset(): forget the latest reading (after fork)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef rsspeak_getset[] = {
    {"last", rsspeak_get_last, NULL, "(the latest reading, when it began in ns)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RssPeakType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "perfsdk._fastpath.RssPeak",
    .tp_basicsize = sizeof(RssPeakObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RssPeak(reuse_ns): memory=True's peak-RSS readings on the host "
              "(perfsdk.memory._RssPeakPython, compiled).",
    .tp_new = PyType_GenericNew,
    .tp_init = rsspeak_init,
    .tp_methods = rsspeak_methods,
    .tp_getset = rsspeak_getset,
};

static PyMethodDef fastpath_methods[] = {
    {"host_times", (PyCFunction)(void (*)(void))fastpath_host_times, METH_FASTCALL,
     "host_times(records, SPEC, T0, T1, DEVICE_MS, ERROR, ATTRS, keys) -> ({spec: [host ms]}, "
     "[records with more]): the summary's pass over a chunk of records."},
    {"maxrss", fastpath_maxrss, METH_NOARGS,
     "maxrss() -> int: the process's peak resident set size in bytes (ru_maxrss)."},
    {"region_exit", (PyCFunction)(void (*)(void))fastpath_region_exit, METH_FASTCALL,
     "region_exit(region, error, t1): region.exit(error, t1), its common case compiled."},
    {"bind_region", fastpath_bind_region, METH_VARARGS,
     "bind_region(CURRENT, perfsdk._device's globals, torch.cuda): for RegionStart."},
    {"new_id", fastpath_new_id, METH_O,
     "new_id(bits) -> int: the next span (64) or trace (128) id of the compiled generator."},
    {"bind_inner", fastpath_bind_inner, METH_VARARGS,
     "bind_inner(globals, InnerRegion, Region, NULL_REGION, state, fork, Context) -> the "
     "compiled InnerRegion.exit."},
    {"track", (PyCFunction)(void (*)(void))fastpath_track, METH_FASTCALL,
     "track(open_, first, inputs, output): perfsdk.auto.backward.track, compiled."},
    {"bind_module", fastpath_bind_module, METH_O,
     "bind_module(globals): perfsdk.auto.module's globals, for ModuleCall."},
    {"step_start", (PyCFunction)(void (*)(void))fastpath_step_start, METH_FASTCALL,
     "step_start(steps, samples, flops, implicit) -> Step: perfsdk.auto.steps._step_python, "
     "its common case compiled."},
    {"step_end", (PyCFunction)(void (*)(void))fastpath_step_end, METH_FASTCALL,
     "step_end(steps, step, error): Steps._end(steps, step, error), its common case compiled."},
    {"bind_phase", fastpath_bind_phase, METH_VARARGS,
     "bind_phase(phase, __enter__, __exit__) -> (__enter__, __exit__): the with block, "
     "compiled."},
    {"step_methods", fastpath_step_methods, METH_NOARGS,
     "step_methods() -> (__enter__, __exit__): Step's with, compiled (after bind_steps)."},
    {"bind_steps", fastpath_bind_steps, METH_VARARGS,
     "bind_steps(steps globals, distributed globals, Steps, Step): for step_start, step_end."},
    {"bind_backward", fastpath_bind_backward, METH_O,
     "bind_backward(globals): perfsdk.auto.backward's globals, for NodeHook."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "perfsdk._fastpath",
    .m_doc = "perfsdk's optional compiled hot path (see perfsdk/markers.py, perfsdk/memory.py).",
    .m_size = -1,
    .m_methods = fastpath_methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    PyObject *module = PyModule_Create(&fastpath_module);
    if (module == NULL) {
        return NULL;
    }
    ids_seed();
    if (pthread_atfork(NULL, NULL, ids_seed) != 0) { /* a child must not repeat our ids */
        PyErr_SetString(PyExc_RuntimeError, "perfsdk._fastpath: pthread_atfork failed");
        Py_DECREF(module);
        return NULL;
    }
    if (intern_names() < 0 || (int_64 = PyLong_FromLong(64)) == NULL
        || (int_done = PyLong_FromLong(-2)) == NULL || PyType_Ready(&NodeHookType) < 0
        || PyType_Ready(&InnerGateType) < 0 || PyType_Ready(&RssPeakType) < 0
        || PyType_Ready(&ModuleCallType) < 0 || PyType_Ready(&RegionStartType) < 0
        || PyType_Ready(&PhaseEnterType) < 0 || PyType_Ready(&PhaseExitType) < 0
        || PyType_Ready(&TwinMethodType) < 0 || PyType_Ready(&BoundTwinType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&RssPeakType);
    if (PyModule_AddObject(module, "RssPeak", (PyObject *)&RssPeakType) < 0) {
        Py_DECREF(&RssPeakType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&NodeHookType);
    if (PyModule_AddObject(module, "NodeHook", (PyObject *)&NodeHookType) < 0) {
        Py_DECREF(&NodeHookType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&InnerGateType);
    if (PyModule_AddObject(module, "InnerGate", (PyObject *)&InnerGateType) < 0) {
        Py_DECREF(&InnerGateType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&ModuleCallType);
    if (PyModule_AddObject(module, "ModuleCall", (PyObject *)&ModuleCallType) < 0) {
        Py_DECREF(&ModuleCallType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&TwinMethodType);
    if (PyModule_AddObject(module, "TwinMethod", (PyObject *)&TwinMethodType) < 0) {
        Py_DECREF(&TwinMethodType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&PhaseEnterType);
    if (PyModule_AddObject(module, "PhaseEnter", (PyObject *)&PhaseEnterType) < 0) {
        Py_DECREF(&PhaseEnterType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&PhaseExitType);
    if (PyModule_AddObject(module, "PhaseExit", (PyObject *)&PhaseExitType) < 0) {
        Py_DECREF(&PhaseExitType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&RegionStartType);
    if (PyModule_AddObject(module, "RegionStart", (PyObject *)&RegionStartType) < 0) {
        Py_DECREF(&RegionStartType);
        Py_DECREF(module);
        return NULL;
    }
#ifdef PERFSDK_NVTX
    domains = PyDict_New();
    if (domains == NULL || PyType_Ready(&NvtxCallType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&NvtxCallType);
    if (PyModule_AddObject(module, "NvtxCall", (PyObject *)&NvtxCallType) < 0) {
        Py_DECREF(&NvtxCallType);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "HAVE_NVTX", 1) < 0) {
#else
    if (PyModule_AddIntConstant(module, "HAVE_NVTX", 0) < 0) {
#endif
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
