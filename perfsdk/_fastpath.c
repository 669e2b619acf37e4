/* perfsdk._fastpath: the optional compiled hot path.
 *
 * Two things, each with a pure-Python twin that passes the same tests (perfsdk/markers.py and
 * perfsdk/memory.py choose; PERFSDK_DISABLE_EXTENSIONS=1 makes them ignore this module):
 *
 * - NvtxCall(domain, message, color, category, payload): a region's NVTX range, built once.
 *   Calling it as call(fn, args, kwargs) pushes the range, calls fn(*args, **kwargs) and pops
 *   the range, also when fn raises. @profiled's wrapper calls it in NVTX-only mode
 *   (PERFSDK_TIMING=0). Built only where the NVTX v3 headers were found (HAVE_NVTX); NVTX is
 *   header-only, so this module is its own NVTX client: nvtxDomainCreateA with the domain's name
 *   gives the tool the same domain the nvtx package's ranges land on (tools key domains by
 *   name), and the category id is the one the nvtx package registered in that domain.
 * - maxrss(): the process's peak resident set size in bytes (getrusage's ru_maxrss), without
 *   building a struct_rusage object. On Linux it asks for RUSAGE_THREAD: the kernel reports the
 *   address space's high-water mark for it too (the same value as RUSAGE_SELF), without
 *   summing the CPU times of every thread.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RUSAGE_THREAD */
#endif
#include <Python.h>
#include <errno.h>
#include <string.h>
#include <sys/resource.h>

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
};
#endif /* PERFSDK_NVTX */

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

static PyMethodDef fastpath_methods[] = {
    {"maxrss", fastpath_maxrss, METH_NOARGS,
     "maxrss() -> int: the process's peak resident set size in bytes (ru_maxrss)."},
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
