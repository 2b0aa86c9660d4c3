/*
 * A tiny stand-in for libnvidia-ml.so.1 so the real pynvml glue in onbox/sources/nvml.py runs in CI
 * without a GPU. Built by tests/onbox/test_nvml_stub.py:
 *
 *   gcc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 stub_nvml.c
 *
 * Add -DSTUB_LEGACY for an "old driver": it exports the deprecated ClocksThrottleReasons and
 * ComputeRunningProcesses_v2 instead of ClocksEventReasons and ComputeRunningProcesses_v3.
 *
 * Behaviour is read from the environment at call time:
 *   FAKE_NVML_NO_DRIVER=1        nvmlInitWithFlags returns NVML_ERROR_DRIVER_NOT_LOADED
 *   FAKE_NVML_COUNT=N            number of GPUs (default 2, at most 8)
 *   FAKE_NVML_TEMP=C             GPU temperature (default 45)
 *   FAKE_NVML_REASONS=MASK       clock-event reason bitmask (default 0)
 *   FAKE_NVML_ECC_UNC=N          volatile uncorrected ECC count (default 0)
 *   FAKE_NVML_LOST_INDEX=I       every device getter on GPU I returns NVML_ERROR_GPU_IS_LOST
 *   FAKE_NVML_NOT_SUPPORTED=a,b  these getters return NVML_ERROR_NOT_SUPPORTED ("all" for every one):
 *                                memory util temperature power limit clock maxclock reasons violation
 *                                ecc remap procs events
 *   FAKE_NVML_XID=I:CODE         the first event wait after GPU I registered delivers Xid CODE
 *   FAKE_NVML_HANG_MS=MS         the first nvmlDeviceGetTemperature call blocks for MS milliseconds
 *
 * Deliberately missing (so FunctionNotFound is exercised): nvmlDeviceGetMemoryInfo_v2,
 * nvmlDeviceGetFieldValues. nvmlDeviceGetRetiredPagesPendingStatus is NotSupported, as on H100.
 * fakeNvmlInitCount() and fakeNvmlEventSetsLive() are test hooks, not NVML.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
};

#define MAX_GPUS 8
#define XID_CRITICAL 0x8ULL
#define MIB (1024ULL * 1024ULL)

struct fake_device { unsigned int index; };
typedef struct fake_device *nvmlDevice_t;

struct fake_event_set { unsigned long long types[MAX_GPUS]; int delivered; };
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long referenceTime, violationTime; } nvmlViolationTime_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

static struct fake_device devices[MAX_GPUS] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static const unsigned int pci_bus[MAX_GPUS] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};
static int init_count = 0;
static int event_sets_live = 0;
static int hang_done = 0;

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    return (v && *v) ? strtol(v, NULL, 0) : fallback;
}

static int device_count(void) {
    long n = env_long("FAKE_NVML_COUNT", 2);
    return (int)(n < 0 ? 0 : (n > MAX_GPUS ? MAX_GPUS : n));
}

static int unsupported(const char *what) {
    const char *list = getenv("FAKE_NVML_NOT_SUPPORTED");
    char padded[256], needle[64];
    if (!list || !*list) return 0;
    snprintf(padded, sizeof padded, ",%s,", list);
    snprintf(needle, sizeof needle, ",%s,", what);
    return strstr(padded, needle) != NULL || strstr(padded, ",all,") != NULL;
}

/* Common checks for a device getter: initialised, valid handle, not lost, supported. */
static nvmlReturn_t check(nvmlDevice_t dev, const char *what) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!dev || dev->index >= (unsigned int)device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    if ((long)dev->index == env_long("FAKE_NVML_LOST_INDEX", -1)) return NVML_ERROR_GPU_IS_LOST;
    if (what && unsupported(what)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {}
}

int fakeNvmlInitCount(void) { return init_count; }
int fakeNvmlEventSetsLive(void) { return event_sets_live; }

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (env_long("FAKE_NVML_NO_DRIVER", 0)) return NVML_ERROR_DRIVER_NOT_LOADED;
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    static char buf[64];
    snprintf(buf, sizeof buf, "stub NVML error %d", result);
    return buf;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    snprintf(version, length, "550.163.01");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    snprintf(version, length, "12.550.163.01");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)device_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (index >= (unsigned int)device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    nvmlReturn_t r = check(dev, NULL);
    if (r == NVML_SUCCESS) snprintf(name, length, "NVIDIA H100 80GB HBM3");
    return r;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    nvmlReturn_t r = check(dev, NULL);
    if (r == NVML_SUCCESS) snprintf(uuid, length, "GPU-5fa0c3b1-7e21-4c0d-9a6b-00000000000%u", dev->index);
    return r;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci) {
    nvmlReturn_t r = check(dev, NULL);
    if (r != NVML_SUCCESS) return r;
    memset(pci, 0, sizeof *pci);
    pci->bus = pci_bus[dev->index];
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    nvmlReturn_t r = check(dev, "memory");
    if (r != NVML_SUCCESS) return r;
    mem->total = 81559ULL * MIB;
    mem->used = (40960ULL + 1024ULL * dev->index) * MIB;
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *util) {
    nvmlReturn_t r = check(dev, "util");
    if (r != NVML_SUCCESS) return r;
    util->gpu = 90 + dev->index;
    util->memory = 40 + dev->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, int sensor, unsigned int *temp) {
    nvmlReturn_t r = check(dev, "temperature");
    long hang_ms = env_long("FAKE_NVML_HANG_MS", 0);
    if (r != NVML_SUCCESS) return r;
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (hang_ms > 0 && !hang_done) {
        hang_done = 1;
        sleep_ms(hang_ms);
    }
    *temp = (unsigned int)env_long("FAKE_NVML_TEMP", 45);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t dev, unsigned int *mw) {
    nvmlReturn_t r = check(dev, "power");
    if (r == NVML_SUCCESS) *mw = 350000 + 1000 * dev->index;
    return r;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t dev, unsigned int *mw) {
    nvmlReturn_t r = check(dev, "limit");
    if (r == NVML_SUCCESS) *mw = 700000;
    return r;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t dev, int type, unsigned int *mhz) {
    nvmlReturn_t r = check(dev, "clock");
    if (r == NVML_SUCCESS) *mhz = type == 1 ? 1755 : 2619;
    return r;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t dev, int type, unsigned int *mhz) {
    nvmlReturn_t r = check(dev, "maxclock");
    if (r == NVML_SUCCESS) *mhz = type == 1 ? 1980 : 2619;
    return r;
}

static nvmlReturn_t reasons(nvmlDevice_t dev, unsigned long long *mask) {
    nvmlReturn_t r = check(dev, "reasons");
    if (r == NVML_SUCCESS) *mask = (unsigned long long)env_long("FAKE_NVML_REASONS", 0);
    return r;
}

#ifdef STUB_LEGACY
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *mask) {
    return reasons(dev, mask);
}
#else
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t dev, unsigned long long *mask) {
    return reasons(dev, mask);
}
#endif

nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t dev, int policy, nvmlViolationTime_t *v) {
    nvmlReturn_t r = check(dev, "violation");
    if (r != NVML_SUCCESS) return r;
    v->referenceTime = 1700000000000000ULL;
    v->violationTime = policy == 0 ? 5000000ULL : (policy == 1 ? 250000000ULL : 0ULL);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, int errorType, int counterType,
                                         unsigned long long *count) {
    nvmlReturn_t r = check(dev, "ecc");
    if (r != NVML_SUCCESS) return r;
    if (errorType == 1 && counterType == 0) *count = (unsigned long long)env_long("FAKE_NVML_ECC_UNC", 0);
    else if (errorType == 0) *count = counterType == 0 ? 3 : 17;
    else *count = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t dev, int *pending) {
    nvmlReturn_t r = check(dev, NULL);
    (void)pending;
    return r == NVML_SUCCESS ? NVML_ERROR_NOT_SUPPORTED : r;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    nvmlReturn_t r = check(dev, "remap");
    if (r != NVML_SUCCESS) return r;
    *corr = 0;
    *unc = 1;
    *pending = 1;
    *failure = 0;
    return NVML_SUCCESS;
}

/* One process per GPU, pid 4242 + index, 40 GiB. Follows NVML's two-call size protocol. */
static nvmlReturn_t processes(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos) {
    nvmlReturn_t r = check(dev, "procs");
    if (r != NVML_SUCCESS) return r;
    if (!infos || *count < 1) {
        *count = 1;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memset(infos, 0, sizeof *infos);
    infos[0].pid = 4242 + dev->index;
    infos[0].usedGpuMemory = 40960ULL * MIB;
    infos[0].gpuInstanceId = 0xffffffffu;
    infos[0].computeInstanceId = 0xffffffffu;
    *count = 1;
    return NVML_SUCCESS;
}

#ifdef STUB_LEGACY
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return processes(dev, count, infos);
}
#else
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return processes(dev, count, infos);
}
#endif

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t dev, unsigned long long *types) {
    nvmlReturn_t r = check(dev, "events");
    if (r == NVML_SUCCESS) *types = 0x1ULL | 0x2ULL | 0x4ULL | XID_CRITICAL | 0x10ULL;
    return r;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    *set = calloc(1, sizeof **set);
    if (!*set) return NVML_ERROR_INVALID_ARGUMENT;
    event_sets_live++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long types, nvmlEventSet_t set) {
    nvmlReturn_t r = check(dev, "events");
    if (r != NVML_SUCCESS) return r;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    set->types[dev->index] |= types;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    const char *xid = getenv("FAKE_NVML_XID");
    unsigned int index = 0, code = 0;
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    if (xid && sscanf(xid, "%u:%u", &index, &code) == 2 && index < MAX_GPUS && !set->delivered &&
        (set->types[index] & XID_CRITICAL)) {
        set->delivered = 1;
        memset(data, 0, sizeof *data);
        data->device = &devices[index];
        data->eventType = XID_CRITICAL;
        data->eventData = code;
        data->gpuInstanceId = data->computeInstanceId = 0xffffffffu;
        return NVML_SUCCESS;
    }
    sleep_ms((long)timeoutms);
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    event_sets_live--;
    return NVML_SUCCESS;
}
