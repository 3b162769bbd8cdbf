// The inference call of an optimized module as one C++ function (runtime/shortcut.py).
//
// OptimizedModule.__call__'s shortcut, in Python, checks that nothing changed since the
// previous call (no hooks, not traced, the inputs of the same kind, every submodule in eval
// mode, the weights' version counters, the thread count), takes the plan's lock, picks a free
// output buffer and runs the recorded native program. On a cold cache (the previous layer's
// data evicted the interpreter's) those Python operations cost 40-60 us, a tenth of a 0.5 ms
// fused kernel. Here they are one C++ call that touches a few cache lines of each object.
//
// `Shortcut(...)(inputs)` returns the output, or None where any check fails: the caller then
// takes the Python path, which decides everything again (this object never decides more
// than that path would). `Recycler` is the output pool of runtime/planned_steps.Recycled:
// both paths take buffers from it.
#include <Python.h>
#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <vector>

namespace {

// ------------------------------------------------------------------------ Recycler

// A kept buffer is free when nothing outside the pool holds its storage: every tensor (a
// handed-out output, a view of it, a NumPy array's or DLPack capsule's tensor) holds one
// reference to the storage, the pool's own tensor the only other. The storage's Python
// object, once made (out.untyped_storage(), a profiler), lives on with the storage and holds
// one reference too: then the storage is free when that object's only reference is the
// storage's own (nobody in Python holds it). And its memory must still be where it was
// (share_memory_() and resize_() move it). shortcut.py checks these rules on the loaded
// PyTorch before any plan uses the pool (protocol_ok).
bool unshared(const c10::Storage& st) {
  PyObject* py = st.unsafeGetStorageImpl()->pyobj_slot()->load_pyobj();
  if (py == nullptr) return st.use_count() == 1;
  return st.use_count() == 2 && Py_REFCNT(py) == 1;
}

struct Kept {
  at::Tensor buffer;  // never handed out: only its storage is shared
  const void* data;
  size_t nbytes;
  bool free() const {
    const c10::Storage& st = buffer.storage();
    return st.data() == data && st.nbytes() == nbytes && unshared(st);
  }
};

struct Recycler {
  PyObject_HEAD
  PyObject* allocate;  // () -> a new buffer (a tensor of the output's type)
  std::vector<Kept>* kept;
  Py_ssize_t keep;
  Py_ssize_t next;  // the kept buffer a new allocation replaces
};

// A new tensor object over a kept buffer's storage: detach() keeps the buffer's inference
// mode, is no view and has no autograd history.
PyObject* hand_out(const at::Tensor& t) {
  try {
    return THPVariable_Wrap(t.detach());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// Recycled.take: a free buffer made in the call's inference mode, else a new one (which
// replaces a free buffer of the other mode, else the oldest kept).
PyObject* recycler_take(Recycler* r) {
  const bool mode = c10::InferenceMode::is_enabled();
  std::vector<Kept>& kept = *r->kept;
  Py_ssize_t spare = -1;
  for (size_t i = 0; i < kept.size(); ++i) {
    if (kept[i].free()) {
      if (kept[i].buffer.is_inference() == mode) return hand_out(kept[i].buffer);
      spare = static_cast<Py_ssize_t>(i);
    }
  }
  PyObject* fresh = PyObject_CallNoArgs(r->allocate);
  if (fresh == nullptr) return nullptr;
  if (!THPVariable_Check(fresh)) {
    Py_DECREF(fresh);
    PyErr_SetString(PyExc_TypeError, "Recycler: allocate() must return a tensor");
    return nullptr;
  }
  at::Tensor mine = THPVariable_Unpack(fresh);
  Py_DECREF(fresh);
  const c10::Storage& st = mine.storage();
  if (!unshared(st)) return hand_out(mine);  // shared already: never kept
  Kept entry{mine, st.data(), st.nbytes()};
  if (spare >= 0) {
    kept[spare] = entry;
  } else if (static_cast<Py_ssize_t>(kept.size()) < r->keep) {
    kept.push_back(entry);
  } else {
    kept[r->next] = entry;
    r->next = (r->next + 1) % r->keep;
  }
  return hand_out(mine);
}

PyObject* Recycler_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  static const char* names[] = {"allocate", "keep", nullptr};
  PyObject* allocate;
  Py_ssize_t keep;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "On", const_cast<char**>(names), &allocate,
                                   &keep))
    return nullptr;
  if (!PyCallable_Check(allocate) || keep < 1) {
    PyErr_SetString(PyExc_ValueError, "Recycler(allocate, keep): a callable and keep >= 1");
    return nullptr;
  }
  auto* r = reinterpret_cast<Recycler*>(type->tp_alloc(type, 0));
  if (r == nullptr) return nullptr;
  Py_INCREF(allocate);
  r->allocate = allocate;
  r->kept = new std::vector<Kept>();
  r->keep = keep;
  r->next = 0;
  return reinterpret_cast<PyObject*>(r);
}

int Recycler_traverse(Recycler* r, visitproc visit, void* arg) {
  Py_VISIT(r->allocate);
  return 0;
}

int Recycler_clear(Recycler* r) {
  Py_CLEAR(r->allocate);
  return 0;
}

void Recycler_dealloc(Recycler* r) {
  PyObject_GC_UnTrack(r);
  Recycler_clear(r);
  delete r->kept;
  Py_TYPE(r)->tp_free(reinterpret_cast<PyObject*>(r));
}

PyObject* Recycler_take(Recycler* r, PyObject*) { return recycler_take(r); }

PyObject* Recycler_buffers(Recycler* r, PyObject*) {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const Kept& k : *r->kept) {
    PyObject* t = THPVariable_Wrap(k.buffer);
    if (t == nullptr || PyList_Append(out, t) < 0) {
      Py_XDECREF(t);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(t);
  }
  return out;
}

PyMethodDef Recycler_methods[] = {
    {"take", reinterpret_cast<PyCFunction>(Recycler_take), METH_NOARGS,
     "A tensor of the output's type over memory nothing outside the pool holds."},
    {"buffers", reinterpret_cast<PyCFunction>(Recycler_buffers), METH_NOARGS,
     "The buffers kept (each in the user's hands or free for the next call)."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject RecyclerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ------------------------------------------------------------------------ Shortcut

struct InputGuard {
  PyTypeObject* type;
  at::ScalarType dtype;
  c10::Device device;
  std::vector<int64_t> sizes, strides;
  bool requires_grad;
  uint64_t keys;
};

typedef int (*run_fn)(const void* steps, int n, const intptr_t* slots);

struct Shortcut {
  PyObject_HEAD
  PyObject* module_dict;  // the optimized module's __dict__
  PyObject* repeat;       // its _Repeat when this was made: serves while still its
  PyObject* weights;      // its WeightSnapshot then: the same
  PyObject* entry;        // the plan's Compiled (the module's _latest after a call)
  PyObject* global_hooks;    // tuple of nn.Module's global hook dicts
  PyObject* tracing_state;   // torch._C._get_tracing_state
  PyObject* training_dicts;  // tuple of every submodule's __dict__
  PyObject* registrations;   // weights._registrations: [0] is the epoch
  PyObject* acquire;         // the plan's lock: acquire and release
  PyObject* release;
  PyObject* names;      // tuple of step names (a failing step's error)
  PyObject* output;     // a Recycler, or None (a new tensor each call)
  PyObject* keep;       // what the steps' addresses point into
  std::vector<InputGuard>* guards;
  std::vector<at::Tensor>* tracked;  // the weights with a version counter
  std::vector<int64_t>* versions;
  std::vector<int64_t>* out_sizes;   // a new output's geometry, where output is None
  std::vector<int64_t>* out_strides;
  std::vector<intptr_t>* slots;
  at::ScalarType out_dtype;
  long long epoch;
  int threads;
  uint64_t tls_included, tls_excluded;
  run_fn run;
  const void* steps;
  int n;
};

PyObject* s_fallback_reason;
PyObject* s_compiled_call_impl;
PyObject* s_hooks[4];
PyObject* s_repeat;
PyObject* s_weights;
PyObject* s_latest;
PyObject* s_training;

bool guard_ok(const InputGuard& g, PyObject* obj) {
  if (Py_TYPE(obj) != g.type) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.scalar_type() != g.dtype || t.device() != g.device ||
      t.requires_grad() != g.requires_grad || t.key_set().raw_repr() != g.keys)
    return false;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const size_t d = g.sizes.size();
  if (sizes.size() != d) return false;
  for (size_t i = 0; i < d; ++i)
    if (sizes[i] != g.sizes[i] || strides[i] != g.strides[i]) return false;
  return true;
}

bool empty_dict(PyObject* d) { return d != nullptr && PyDict_Check(d) && PyDict_GET_SIZE(d) == 0; }

// Everything the Python shortcut checks before it runs the plan; false: take that path.
bool checks_pass_or_throw(Shortcut* s, PyObject* inputs) {
  PyObject* md = s->module_dict;
  if (md == nullptr) return false;  // cleared by the garbage collector
  if (PyDict_GetItem(md, s_repeat) != s->repeat || PyDict_GetItem(md, s_weights) != s->weights ||
      PyDict_GetItem(md, s_fallback_reason) != Py_None)
    return false;
  // nn.Module.compile() sets it on the instance (the class's own is None)
  PyObject* compiled = PyDict_GetItem(md, s_compiled_call_impl);
  if (compiled != nullptr && compiled != Py_None) return false;
  for (PyObject* key : s_hooks)
    if (!empty_dict(PyDict_GetItem(md, key))) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(s->global_hooks); ++i)
    if (!empty_dict(PyTuple_GET_ITEM(s->global_hooks, i))) return false;
  const c10::impl::PODLocalDispatchKeySet tls = c10::impl::raw_local_dispatch_key_set;
  if (tls.included_ != s->tls_included || tls.excluded_ != s->tls_excluded) return false;
  const std::vector<InputGuard>& guards = *s->guards;
  if (!PyTuple_Check(inputs) || PyTuple_GET_SIZE(inputs) != static_cast<Py_ssize_t>(guards.size()))
    return false;
  for (size_t i = 0; i < guards.size(); ++i)
    if (!guard_ok(guards[i], PyTuple_GET_ITEM(inputs, i))) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(s->training_dicts); ++i)
    if (PyDict_GetItem(PyTuple_GET_ITEM(s->training_dicts, i), s_training) != Py_False)
      return false;
  PyObject* epoch = PyList_GET_ITEM(s->registrations, 0);
  if (!PyLong_CheckExact(epoch) || PyLong_AsLongLong(epoch) != s->epoch) return false;
  const std::vector<at::Tensor>& tracked = *s->tracked;
  const std::vector<int64_t>& versions = *s->versions;
  for (size_t i = 0; i < tracked.size(); ++i)
    if (tracked[i]._version() != versions[i]) return false;
  if (at::get_num_threads() != s->threads) return false;
  PyObject* tracing = PyObject_CallNoArgs(s->tracing_state);
  if (tracing == nullptr) {
    PyErr_Clear();
    return false;
  }
  Py_DECREF(tracing);
  return tracing == Py_None;
}

bool checks_pass(Shortcut* s, PyObject* inputs) {
  try {
    return checks_pass_or_throw(s, inputs);
  } catch (const std::exception&) {  // a tensor refusing a query: the Python path decides
    return false;
  }
}

// The lock's release, keeping an error this call already raised.
bool release_lock(Shortcut* s) {
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  PyObject* released = PyObject_CallNoArgs(s->release);
  if (released == nullptr) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    return false;
  }
  Py_DECREF(released);
  PyErr_Restore(type, value, trace);
  return true;
}

PyObject* shortcut_call(Shortcut* s, PyObject* inputs) {
  if (!checks_pass(s, inputs)) Py_RETURN_NONE;
  PyObject* got = PyObject_CallOneArg(s->acquire, Py_False);
  if (got == nullptr) return nullptr;
  Py_DECREF(got);
  if (got != Py_True) Py_RETURN_NONE;  // busy: the Python path waits its turn
  PyObject* out = nullptr;
  if (s->output != Py_None) {
    out = recycler_take(reinterpret_cast<Recycler*>(s->output));
  } else {
    try {
      out = THPVariable_Wrap(at::empty_strided(*s->out_sizes, *s->out_strides,
                                               at::TensorOptions().dtype(s->out_dtype)));
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  }
  int rc = 0;
  bool refused = false;  // an input or the output refused its address: the Python path
  if (out != nullptr) {
    std::vector<intptr_t>& slots = *s->slots;
    const Py_ssize_t k = PyTuple_GET_SIZE(inputs);
    try {
      for (Py_ssize_t i = 0; i < k; ++i)
        slots[i] = reinterpret_cast<intptr_t>(
            THPVariable_Unpack(PyTuple_GET_ITEM(inputs, i)).data_ptr());
      slots[k] = reinterpret_cast<intptr_t>(THPVariable_Unpack(out).data_ptr());
    } catch (const std::exception&) {
      refused = true;
    }
    if (!refused) {
      const run_fn run = s->run;
      const void* steps = s->steps;
      const int n = s->n;
      const intptr_t* sl = slots.data();
      Py_BEGIN_ALLOW_THREADS rc = run(steps, n, sl);
      Py_END_ALLOW_THREADS
    }
  }
  if (!release_lock(s)) {
    Py_XDECREF(out);
    return nullptr;
  }
  if (out == nullptr) return nullptr;
  if (refused) {
    Py_DECREF(out);
    Py_RETURN_NONE;
  }
  if (rc != 0) {
    Py_DECREF(out);
    PyObject* name = rc - 1 < PyTuple_GET_SIZE(s->names) ? PyTuple_GET_ITEM(s->names, rc - 1) : Py_None;
    PyErr_Format(PyExc_RuntimeError, "native runner: step %S reported a failure", name);
    return nullptr;
  }
  if (PyDict_GetItem(s->module_dict, s_latest) != s->entry &&
      PyDict_SetItem(s->module_dict, s_latest, s->entry) < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

PyObject* Shortcut_call(PyObject* self, PyObject* args, PyObject* kwds) {
  PyObject* inputs;
  if (kwds != nullptr && PyDict_GET_SIZE(kwds) != 0) {
    PyErr_SetString(PyExc_TypeError, "Shortcut(inputs): no keywords");
    return nullptr;
  }
  if (!PyArg_UnpackTuple(args, "Shortcut", 1, 1, &inputs)) return nullptr;
  return shortcut_call(reinterpret_cast<Shortcut*>(self), inputs);
}

bool int64s(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "a sequence of integers");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

bool all_tensors(PyObject* tup, const char* what) {
  if (!PyTuple_Check(tup)) {
    PyErr_Format(PyExc_TypeError, "Shortcut: %s must be a tuple of tensors", what);
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tup); ++i)
    if (!THPVariable_Check(PyTuple_GET_ITEM(tup, i))) {
      PyErr_Format(PyExc_TypeError, "Shortcut: %s must be a tuple of tensors", what);
      return false;
    }
  return true;
}

PyObject* Shortcut_new(PyTypeObject* type, PyObject* args, PyObject* kwds) {
  static const char* names[] = {"module_dict", "repeat", "weights", "entry", "inputs",
                                "global_hooks", "tracing_state", "training_dicts",
                                "registrations", "epoch", "tracked", "versions", "threads",
                                "lock", "run", "steps", "n", "names", "output", "keep",
                                nullptr};
  PyObject *module_dict, *repeat, *weights, *entry, *inputs, *global_hooks, *tracing_state;
  PyObject *training_dicts, *registrations, *tracked, *versions, *lock, *step_names;
  PyObject *output, *keep;
  long long epoch, run, steps;
  int threads, n;
  if (!PyArg_ParseTupleAndKeywords(
          args, kwds, "O!OOOO!O!OO!O!LO!OiOLLiO!OO", const_cast<char**>(names), &PyDict_Type,
          &module_dict, &repeat, &weights, &entry, &PyTuple_Type, &inputs, &PyTuple_Type,
          &global_hooks, &tracing_state, &PyTuple_Type, &training_dicts, &PyList_Type,
          &registrations, &epoch, &PyTuple_Type, &tracked, &versions, &threads, &lock, &run,
          &steps, &n, &PyTuple_Type, &step_names, &output, &keep))
    return nullptr;
  if (!all_tensors(inputs, "inputs") || !all_tensors(tracked, "tracked")) return nullptr;
  if (PyList_GET_SIZE(registrations) < 1) {
    PyErr_SetString(PyExc_ValueError, "Shortcut: registrations must hold the epoch");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(global_hooks); ++i)
    if (!PyDict_Check(PyTuple_GET_ITEM(global_hooks, i))) {
      PyErr_SetString(PyExc_TypeError, "Shortcut: global_hooks must be dicts");
      return nullptr;
    }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(training_dicts); ++i)
    if (!PyDict_Check(PyTuple_GET_ITEM(training_dicts, i))) {
      PyErr_SetString(PyExc_TypeError, "Shortcut: training_dicts must be dicts");
      return nullptr;
    }
  const bool recycled = PyObject_TypeCheck(output, &RecyclerType);
  if (!recycled && !THPVariable_Check(output)) {
    PyErr_SetString(PyExc_TypeError, "Shortcut: output must be a Recycler or a sample tensor");
    return nullptr;
  }
  PyObject* acquire = PyObject_GetAttrString(lock, "acquire");
  PyObject* release = acquire ? PyObject_GetAttrString(lock, "release") : nullptr;
  if (release == nullptr) {
    Py_XDECREF(acquire);
    return nullptr;
  }
  auto* s = reinterpret_cast<Shortcut*>(type->tp_alloc(type, 0));
  if (s == nullptr) {
    Py_DECREF(acquire);
    Py_DECREF(release);
    return nullptr;
  }
  s->acquire = acquire;
  s->release = release;
  PyObject** held[] = {&s->module_dict, &s->repeat, &s->weights, &s->entry,
                       &s->global_hooks, &s->tracing_state, &s->training_dicts,
                       &s->registrations, &s->names, &s->output, &s->keep};
  PyObject* given[] = {module_dict, repeat, weights, entry, global_hooks, tracing_state,
                       training_dicts, registrations, step_names, recycled ? output : Py_None,
                       keep};
  for (size_t i = 0; i < sizeof(given) / sizeof(given[0]); ++i) {
    Py_INCREF(given[i]);
    *held[i] = given[i];
  }
  s->guards = new std::vector<InputGuard>();
  s->tracked = new std::vector<at::Tensor>();
  s->versions = new std::vector<int64_t>();
  s->out_sizes = new std::vector<int64_t>();
  s->out_strides = new std::vector<int64_t>();
  s->slots = new std::vector<intptr_t>(PyTuple_GET_SIZE(inputs) + 1, 0);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(inputs); ++i) {
    PyObject* obj = PyTuple_GET_ITEM(inputs, i);
    const at::Tensor& t = THPVariable_Unpack(obj);
    Py_INCREF(Py_TYPE(obj));  // held: a freed type's address must never match again
    s->guards->push_back(InputGuard{Py_TYPE(obj), t.scalar_type(), t.device(),
                                    t.sizes().vec(), t.strides().vec(), t.requires_grad(),
                                    t.key_set().raw_repr()});
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tracked); ++i)
    s->tracked->push_back(THPVariable_Unpack(PyTuple_GET_ITEM(tracked, i)));
  if (!int64s(versions, *s->versions) || s->versions->size() != s->tracked->size()) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "Shortcut: one version per tracked tensor");
    Py_DECREF(s);
    return nullptr;
  }
  if (!recycled) {
    const at::Tensor& sample = THPVariable_Unpack(output);
    *s->out_sizes = sample.sizes().vec();
    *s->out_strides = sample.strides().vec();
    s->out_dtype = sample.scalar_type();
    if (!sample.device().is_cpu()) {
      PyErr_SetString(PyExc_ValueError, "Shortcut: CPU plans only");
      Py_DECREF(s);
      return nullptr;
    }
  }
  const c10::impl::PODLocalDispatchKeySet tls = c10::impl::raw_local_dispatch_key_set;
  s->tls_included = tls.included_;
  s->tls_excluded = tls.excluded_;
  s->epoch = epoch;
  s->threads = threads;
  s->run = reinterpret_cast<run_fn>(static_cast<intptr_t>(run));
  s->steps = reinterpret_cast<const void*>(static_cast<intptr_t>(steps));
  s->n = n;
  return reinterpret_cast<PyObject*>(s);
}

int Shortcut_traverse(Shortcut* s, visitproc visit, void* arg) {
  Py_VISIT(s->module_dict);
  Py_VISIT(s->repeat);
  Py_VISIT(s->weights);
  Py_VISIT(s->entry);
  Py_VISIT(s->global_hooks);
  Py_VISIT(s->tracing_state);
  Py_VISIT(s->training_dicts);
  Py_VISIT(s->registrations);
  Py_VISIT(s->acquire);
  Py_VISIT(s->release);
  Py_VISIT(s->names);
  Py_VISIT(s->output);
  Py_VISIT(s->keep);
  if (s->guards != nullptr)
    for (const InputGuard& g : *s->guards) Py_VISIT(reinterpret_cast<PyObject*>(g.type));
  return 0;
}

int Shortcut_clear(Shortcut* s) {
  Py_CLEAR(s->module_dict);
  Py_CLEAR(s->repeat);
  Py_CLEAR(s->weights);
  Py_CLEAR(s->entry);
  Py_CLEAR(s->global_hooks);
  Py_CLEAR(s->tracing_state);
  Py_CLEAR(s->training_dicts);
  Py_CLEAR(s->registrations);
  Py_CLEAR(s->acquire);
  Py_CLEAR(s->release);
  Py_CLEAR(s->names);
  Py_CLEAR(s->output);
  Py_CLEAR(s->keep);
  if (s->guards != nullptr) {  // no call after a clear: the guards go with their types
    for (const InputGuard& g : *s->guards) Py_DECREF(reinterpret_cast<PyObject*>(g.type));
    s->guards->clear();
  }
  return 0;
}

void Shortcut_dealloc(Shortcut* s) {
  PyObject_GC_UnTrack(s);
  Shortcut_clear(s);
  delete s->guards;
  delete s->tracked;
  delete s->versions;
  delete s->out_sizes;
  delete s->out_strides;
  delete s->slots;
  Py_TYPE(s)->tp_free(reinterpret_cast<PyObject*>(s));
}

PyMemberDef Shortcut_members[] = {
    {"repeat", T_OBJECT_EX, offsetof(Shortcut, repeat), READONLY,
     "the module's _Repeat this call serves"},
    {"weights", T_OBJECT_EX, offsetof(Shortcut, weights), READONLY,
     "the module's WeightSnapshot this call serves"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject ShortcutType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "mw_shortcut",
                          "The inference call of an optimized module as one C++ function.",
                          -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_mw_shortcut(void) {
  RecyclerType.tp_name = "mw_shortcut.Recycler";
  RecyclerType.tp_basicsize = sizeof(Recycler);
  RecyclerType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  RecyclerType.tp_doc = "Recycler(allocate, keep): a graph output's pool of buffers.";
  RecyclerType.tp_new = Recycler_new;
  RecyclerType.tp_dealloc = reinterpret_cast<destructor>(Recycler_dealloc);
  RecyclerType.tp_traverse = reinterpret_cast<traverseproc>(Recycler_traverse);
  RecyclerType.tp_clear = reinterpret_cast<inquiry>(Recycler_clear);
  RecyclerType.tp_methods = Recycler_methods;
  ShortcutType.tp_name = "mw_shortcut.Shortcut";
  ShortcutType.tp_basicsize = sizeof(Shortcut);
  ShortcutType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  ShortcutType.tp_doc = "Shortcut(...)(inputs): the plan's output, or None (take the Python path).";
  ShortcutType.tp_new = Shortcut_new;
  ShortcutType.tp_call = Shortcut_call;
  ShortcutType.tp_dealloc = reinterpret_cast<destructor>(Shortcut_dealloc);
  ShortcutType.tp_traverse = reinterpret_cast<traverseproc>(Shortcut_traverse);
  ShortcutType.tp_clear = reinterpret_cast<inquiry>(Shortcut_clear);
  ShortcutType.tp_members = Shortcut_members;
  if (PyType_Ready(&RecyclerType) < 0 || PyType_Ready(&ShortcutType) < 0) return nullptr;
  const char* hooks[] = {"_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                         "_backward_pre_hooks"};
  for (int i = 0; i < 4; ++i) s_hooks[i] = PyUnicode_InternFromString(hooks[i]);
  s_fallback_reason = PyUnicode_InternFromString("_fallback_reason");
  s_compiled_call_impl = PyUnicode_InternFromString("_compiled_call_impl");
  s_repeat = PyUnicode_InternFromString("_repeat");
  s_weights = PyUnicode_InternFromString("_weights");
  s_latest = PyUnicode_InternFromString("_latest");
  s_training = PyUnicode_InternFromString("training");
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&RecyclerType);
  Py_INCREF(&ShortcutType);
  if (PyModule_AddObject(m, "Recycler", reinterpret_cast<PyObject*>(&RecyclerType)) < 0 ||
      PyModule_AddObject(m, "Shortcut", reinterpret_cast<PyObject*>(&ShortcutType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
