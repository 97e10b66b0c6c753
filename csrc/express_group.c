/* A binding's recurring group described in one call (part of the _express_cycle module; express_ctx.h).
 *
 * read_group(tensors) -> (signature, members)
 *   tensors: a list or tuple of objects with torch's tensor attributes. signature: a tuple with one
 *   (t.dtype, t.shape, t.is_cpu) per tensor, in order; members: a tuple of t.data_ptr() per tensor, or None when
 *   some t.is_contiguous() is not True (data_ptr() is then not read). Any exception a read raises propagates.
 *   What the binding's Python would do with attrgetter and map (ringtrain/torch/group_reads.py, read_python),
 *   without the interpreter's per-attribute and per-call frames: on a small group those are a visible share of
 *   the call (the getters themselves are the framework's). */
#include "express_ctx.h"

static PyObject *s_dtype, *s_shape, *s_is_cpu, *s_is_contiguous, *s_data_ptr;

static int interned(void) {
    if (s_data_ptr) return 0;
    s_dtype = PyUnicode_InternFromString("dtype");
    s_shape = PyUnicode_InternFromString("shape");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    return s_dtype && s_shape && s_is_cpu && s_is_contiguous && s_data_ptr ? 0 : -1;
}

/* (t.dtype, t.shape, t.is_cpu): a new reference, or NULL with the read's exception set */
static PyObject *describe(PyObject *t) {
    PyObject *entry = PyTuple_New(3);
    if (!entry) return NULL;
    PyObject *names[3] = {s_dtype, s_shape, s_is_cpu};
    for (int k = 0; k < 3; k++) {
        PyObject *v = PyObject_GetAttr(t, names[k]);
        if (!v) {
            Py_DECREF(entry);
            return NULL;
        }
        PyTuple_SET_ITEM(entry, k, v);
    }
    return entry;
}

/* t.data_ptr() into *address when t.is_contiguous() is True: 1 (a new reference); 0 when it is not (data_ptr() is
 * then not called); -1 with the exception of either call set */
static int address_of(PyObject *t, PyObject **address) {
    PyObject *call[2] = {NULL, t};        /* (call[0]: the slot ARGUMENTS_OFFSET lets the callee use) */
    PyObject *answer = PyObject_VectorcallMethod(s_is_contiguous, call + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (!answer) return -1;
    int contiguous = answer == Py_True;
    Py_DECREF(answer);
    if (!contiguous) return 0;
    *address = PyObject_VectorcallMethod(s_data_ptr, call + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    return *address ? 1 : -1;
}

PyObject *py_read_group(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.read_group takes one list or tuple of tensors");
        return NULL;
    }
    if (interned() < 0) return NULL;
    PyObject *seq = args[0];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *signature = PyTuple_New(n), *members = PyTuple_New(n);
    if (!signature || !members) goto fail;
    int contiguous = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(seq)) {         /* (a getter may change the list: fetched anew) */
            PyErr_SetString(PyExc_RuntimeError, "express_cycle.read_group: the list changed while it was read");
            goto fail;
        }
        PyObject **items = PySequence_Fast_ITEMS(seq);
        PyObject *t = Py_NewRef(items[i]);        /* (held: a getter may drop the list's reference) */
        PyObject *entry = describe(t), *address = NULL;
        if (entry) {
            PyTuple_SET_ITEM(signature, i, entry);
            if (contiguous) contiguous = address_of(t, &address);
        }
        Py_DECREF(t);
        if (!entry || contiguous < 0) goto fail;
        if (contiguous) PyTuple_SET_ITEM(members, i, address);
    }
    if (!contiguous) {
        Py_DECREF(members);
        members = Py_NewRef(Py_None);
    }
    PyObject *result = PyTuple_Pack(2, signature, members);
    Py_DECREF(signature);
    Py_DECREF(members);
    return result;
fail:
    Py_XDECREF(signature);
    Py_XDECREF(members);
    return NULL;
}
