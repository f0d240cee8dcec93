"""Targets: host detection, forcing and refusing feature sets, what the assembly may
contain for each set, the object-code cache, and the AArch64 (NEON) output."""
import ctypes
import dataclasses
import re

import numpy as np
import pytest
from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm import jit, kernels, target
from ggraph.backends.llvm.kernels.builder import Kernel, i8, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa

HOST = target.host_features()


def runnable(name: str) -> bool:
    return not target.missing_features(name)


def needs(name: str):
    return pytest.mark.skipif(not runnable(name), reason=f"host cannot run {name}")


def asm_of(*emit, name: str) -> str:
    """Assembly of a module holding the kernels `emit` adds, for target `name`."""
    t = target.named_target(name)
    m = ir.Module()
    for e in emit:
        e(m, t)
    return jit.emit_assembly(m, t)


def q8_0_matmul(m, t):
    kernels.qmatmul(m, dtypes.q8_0, 256, 64, t)


def q4_k_matmul(m, t):
    kernels.qmatmul(m, dtypes.q4_k, 256, 64, t)


# -- detection and forcing ---------------------------------------------------------------------
def test_host_target_is_the_best_set_the_host_runs(monkeypatch):
    monkeypatch.delenv("GGRAPH_TARGET", raising=False)
    t = target.host_target()
    assert t.name in target.X86_NAMES and t.executable
    assert not target.missing_features(t.name, HOST)
    better = target.X86_NAMES[target.X86_NAMES.index(t.name) + 1:]
    assert all(not runnable(n) for n in better), "a better feature set was runnable"


def test_detection_trusts_the_feature_map_not_the_cpu_name(monkeypatch):
    monkeypatch.delenv("GGRAPH_TARGET", raising=False)
    only_avx2 = frozenset({"sse", "sse2", "ssse3", "sse4.1", "avx", "avx2", "fma", "f16c", "bmi2"})
    monkeypatch.setattr(target, "host_features", lambda: only_avx2)
    assert target.host_target().name == "avx2"


AMX_HOST = frozenset(target._SETS["amx"][2])


def test_amx_is_chosen_only_with_linux_tile_permission(monkeypatch):
    monkeypatch.delenv("GGRAPH_TARGET", raising=False)
    monkeypatch.setattr(target, "host_features", lambda: AMX_HOST)
    monkeypatch.setattr(target, "tile_permission", lambda: False)
    assert target.host_target().name == "avx512_vnni"
    assert "amx" not in [t.name for t in target.runnable_targets()]
    assert any("permission" in m for m in target.missing_features("amx"))
    assert not target.named_target("amx").executable
    m = ir.Module()
    q4_k_matmul(m, target.named_target("amx"))
    with pytest.raises(ValueError, match="AMX tiles and Linux refused"):
        jit.compile(m, target.named_target("amx"))
    with pytest.raises(ValueError, match="GGRAPH_TARGET=amx.*permission"):
        target.host_target("amx")
    monkeypatch.setattr(target, "tile_permission", lambda: True)
    assert target.host_target().name == "amx"
    assert target.host_target("avx512_vnni").name == "avx512_vnni"      # the old path can still be forced


def test_cpuinfo_features_agree_with_llvms_feature_map():
    import llvmlite.binding as llvm
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here: LLVM's map is used directly")
    llvms = {k for k, v in llvm.get_host_cpu_features().items() if v}
    mine = target._cpuinfo_features(text)
    names = {n for n in target._CPUINFO_FLAGS if n in llvm.get_host_cpu_features()}
    assert mine & names == llvms & names


def test_cpuinfo_parsing_of_both_architectures_and_a_bad_file():
    x86 = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 avx avx2 fma f16c bmi2 avx512f avx512_vnni\n"
    assert target._cpuinfo_features(x86) == {"sse", "sse2", "ssse3", "sse4.1", "avx", "avx2", "fma", "f16c",
                                             "bmi2", "avx512f", "avx512vnni"}
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm asimddp\n"
    assert target._cpuinfo_features(arm) == {"neon", "dotprod"}
    with pytest.raises(ValueError, match="flags"):
        target._cpuinfo_features("processor : 0\n")


def test_forcing_a_target(monkeypatch):
    monkeypatch.setenv("GGRAPH_TARGET", "generic")
    t = target.host_target()
    assert (t.name, t.cpu, t.vector_bits) == ("generic", "x86-64", 128)
    assert t.has("sse2") and not t.has("avx2")


def test_forcing_a_set_the_host_lacks_names_the_missing_features(monkeypatch):
    monkeypatch.setattr(target, "host_features", lambda: frozenset({"sse", "sse2", "avx", "avx2"}))
    monkeypatch.setenv("GGRAPH_TARGET", "avx512_vnni")
    with pytest.raises(ValueError, match=r"GGRAPH_TARGET=avx512_vnni.*avx512f.*avx512vnni"):
        target.host_target()


def test_unknown_target_name():
    with pytest.raises(ValueError, match="unknown target 'avx9'.*avx512_vnni"):
        target.host_target("avx9")


def test_another_architectures_sets_are_for_assembly_only(monkeypatch):
    monkeypatch.setattr(target, "host_arch", lambda: "x86_64")
    t = target.named_target("neon_dotprod")
    assert t.arch == "aarch64" and t.has("dotprod") and not t.executable
    m = ir.Module()
    kernels.fmatmul(m, dtypes.f32, 64, 16, t)
    with pytest.raises(ValueError, match="cannot execute"):
        jit.compile(m, t)
    with pytest.raises(ValueError, match=r"GGRAPH_TARGET=neon_dotprod: that is aarch64 code and this host is "
                                         r"x86_64 \(it runs: .*generic\)"):
        target.host_target("neon_dotprod")


# /proc/cpuinfo's Features line as qemu-user 10 shows it for QEMU_CPU=max, neoverse-n1 and cortex-a72
ARM_CPUINFO = {
    "max": "fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 "
           "sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm sb paca pacg dcpodp sve2 svei8mm i8mm bf16",
    "neoverse-n1": "fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp",
    "cortex-a72": "fp asimd aes pmull sha1 sha2 crc32 cpuid",
}
ARM_CHOICE = {"max": "neon_i8mm", "neoverse-n1": "neon_dotprod", "cortex-a72": "neon"}


def as_aarch64_linux(monkeypatch, features: frozenset):
    monkeypatch.delenv("GGRAPH_TARGET", raising=False)
    monkeypatch.setattr(target, "host_arch", lambda: "aarch64")
    monkeypatch.setattr(target, "host_os", lambda: "linux")
    monkeypatch.setattr(target, "host_features", lambda: features)


@pytest.mark.parametrize("cpu", ARM_CPUINFO)
def test_an_aarch64_linux_host_gets_its_best_neon_set(monkeypatch, cpu):
    feats = target._cpuinfo_features(f"processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: {ARM_CPUINFO[cpu]}\n")
    as_aarch64_linux(monkeypatch, feats)
    best = ARM_CHOICE[cpu]
    t = target.host_target()
    assert (t.name, t.triple, t.executable) == (best, target.AARCH64, True)
    runs = target.AARCH64_NAMES[:target.AARCH64_NAMES.index(best) + 1]
    assert [r.name for r in target.runnable_targets()] == list(runs)         # best last
    assert target.host_names() == target.AARCH64_NAMES
    for name in target.X86_NAMES:
        with pytest.raises(ValueError, match=f"GGRAPH_TARGET={name}: that is x86_64 code and this host is aarch64 "
                                             f"\\(it runs: {', '.join(reversed(runs))}\\)"):
            target.host_target(name)
    for name in set(target.AARCH64_NAMES) - set(runs):
        lacks = [f for f in target._SETS[name][2] if f not in feats]
        with pytest.raises(ValueError, match=f"GGRAPH_TARGET={name}: this host lacks {', '.join(lacks)}$"):
            target.host_target(name)
    assert target.host_target("neon").name == "neon"


def test_an_aarch64_host_without_advsimd_is_refused_by_name(monkeypatch):
    as_aarch64_linux(monkeypatch, frozenset())
    with pytest.raises(ValueError, match="this aarch64 host lacks even the baseline feature set neon \\(neon\\)"):
        target.host_target()
    assert target.runnable_targets() == []


def test_an_unknown_architecture_is_named(monkeypatch):
    monkeypatch.delenv("GGRAPH_TARGET", raising=False)
    monkeypatch.setattr(target, "host_arch", lambda: "riscv64")
    with pytest.raises(ValueError, match="no native feature set for host architecture riscv64"):
        target.host_target()
    assert target.runnable_targets() == [] and target.host_names() == ()


# `sysctl hw.optional` on Apple M1 (no i8mm) and M2 (i8mm), as macOS prints it
M1_SYSCTL = ("hw.optional.arm.FEAT_DotProd: 1\nhw.optional.arm.FEAT_I8MM: 0\nhw.optional.arm.FEAT_BF16: 0\n"
             "hw.optional.floatingpoint: 1\nhw.optional.AdvSIMD: 1\nhw.optional.neon: 1\n")
M2_SYSCTL = M1_SYSCTL.replace("FEAT_I8MM: 0", "FEAT_I8MM: 1")


def test_macos_features_come_from_sysctl():
    assert target._sysctl_features(M1_SYSCTL) == {"neon", "dotprod"}
    assert target._sysctl_features(M2_SYSCTL) == {"neon", "dotprod", "i8mm"}
    assert target._sysctl_features("hw.optional.arm.FEAT_DotProd: 1\n") == {"dotprod"}
    with pytest.raises(ValueError, match="no hw.optional"):
        target._sysctl_features("sysctl: unknown oid 'hw.optional'\n")


@pytest.mark.parametrize("text, best", [(M1_SYSCTL, "neon_dotprod"), (M2_SYSCTL, "neon_i8mm")], ids=["M1", "M2"])
def test_a_mac_gets_mach_o_objects_its_best_set_and_no_system_linker(monkeypatch, text, best):
    monkeypatch.delenv("GGRAPH_TARGET", raising=False)
    monkeypatch.setattr(target, "host_arch", lambda: "aarch64")
    monkeypatch.setattr(target, "host_os", lambda: "darwin")
    monkeypatch.setattr(target, "_host_sysctl", lambda: text)
    monkeypatch.setattr(target, "_host_cpuinfo", lambda: "")
    target.host_features.cache_clear()
    try:
        t = target.host_target()
        assert (t.name, t.triple, t.arch) == (best, "aarch64-apple-macosx11.0.0", "aarch64")
    finally:
        target.host_features.cache_clear()
    monkeypatch.setattr(jit, "host_os", lambda: "darwin")
    assert jit.system_linker() is None                  # JITLink loads Mach-O objects in the process
    # the triple is in the cache keys (Apple's ABI differs), which stay as they were for Linux triples
    linux = dataclasses.replace(t, triple=target.AARCH64)
    assert jit.cache_key("x", t) != jit.cache_key("x", linux) and jit._key_part(t) != jit._key_part(linux)
    assert jit._key_part(linux) == ("target", linux.name, linux.cpu, linux.features)
    m = ir.Module()
    kernels.fmatmul(m, dtypes.f32, 64, 16, t)
    target.init_llvm(True)                              # this x86 process pretends to be a Mac
    obj = jit.emit_object(str(m), t)
    assert obj[:4] == b"\xcf\xfa\xed\xfe"                  # a 64-bit Mach-O object, not ELF


def test_the_linker_is_the_host_architectures_own(monkeypatch, tmp_path):
    x86_ld, cross_ld = tmp_path / "ld", tmp_path / "aarch64-linux-gnu-ld"
    x86_ld.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(11) + (62).to_bytes(2, "little") + bytes(40))   # EM_X86_64
    cross_ld.write_bytes(x86_ld.read_bytes())               # an x86 program that links AArch64 code
    on_path = {"ld": str(x86_ld), "aarch64-linux-gnu-ld": str(cross_ld)}
    monkeypatch.setattr(jit.shutil, "which", on_path.get)
    monkeypatch.setattr(jit, "host_os", lambda: "linux")
    monkeypatch.setattr(jit, "host_arch", lambda: "x86_64")
    assert jit.system_linker() == str(x86_ld)
    monkeypatch.setattr(jit, "host_arch", lambda: "aarch64")          # emulated: the x86 ld cannot link it
    assert jit.system_linker() == str(cross_ld)
    del on_path["aarch64-linux-gnu-ld"]
    assert jit.system_linker() is None                                # JITLink, not a linker that fails
    on_path["ld"] = "/bin/sh-script-ld"                                 # not ELF (unreadable): trusted
    assert jit.system_linker() == "/bin/sh-script-ld"
    del on_path["ld"]
    on_path["aarch64-linux-gnu-ld"] = str(cross_ld)
    assert jit.system_linker() is None                                # no ld at all: JITLink


def test_the_cli_refuses_a_forced_set_before_it_runs(monkeypatch, capsys):
    from ggraph.cli import main
    monkeypatch.setenv("GGRAPH_TARGET", "neon_i8mm" if target.host_arch() == "x86_64" else "avx2")
    assert main(["inspect", "/no/such/file.gguf"]) == 1
    err = capsys.readouterr().err
    assert "code and this host is" in err and "no/such" not in err            # refused before the verb ran
    monkeypatch.setenv("GGRAPH_TARGET", "avx9")
    assert main(["target"]) == 1 and "unknown target 'avx9'" in capsys.readouterr().err


def test_describe_lists_a_variant_per_op():
    d = kernels.describe(target.named_target("avx512_vnni"))
    assert d["qmatmul q4_k"].startswith("vpdpbusd-512: gemm 32 rows (rows as lanes) x 6 tokens")
    assert d["qmatmul q8_0"].startswith("vpdpbusd-512: gemm 32 rows (rows as lanes) x 6 tokens")
    assert "pmaddubsw-256" in kernels.describe(target.named_target("avx2"))["qmatmul q8_0"]
    assert kernels.describe(target.named_target("generic"))["qmatmul q6_k"].startswith("scalar")
    assert {f"get_rows {dt.name}" for dt in kernels.QUANT_TYPES} <= set(d)


# -- capabilities: refused before any IR is emitted ----------------------------------------------
def _isa(name: str) -> Isa:
    k = Kernel(ir.Module(), "probe", ("p",))
    return Isa(k, target.named_target(name))


def test_full_range_u8_dot_needs_vnni():
    isa = _isa("avx2")
    acc = ir.Constant(vec(i32, 8), [0] * 8)
    a = ir.Constant(vec(i8, 32), [200] * 32)
    with pytest.raises(ValueError, match="avx512vnni.*'avx2'"):
        isa.dot(acc, a, a, signed=False, amax=255)
    isa.dot(acc, a, a, signed=False, amax=63)        # small weights fit pmaddubsw


def test_table_lookup_needs_ssse3():
    idx = ir.Constant(vec(i8, 32), [1] * 32)
    with pytest.raises(ValueError, match="ssse3.*'generic'"):
        _isa("generic").lookup16(list(range(16)), idx)


@pytest.mark.parametrize("name,extra,n", [("avx2", (), 32), ("avx2", ("gfni",), 32),
                                          ("avx512_vnni", (), 64), ("avx512_vnni", ("gfni",), 64)])
def test_nibble_split_per_qword(name, extra, n):
    """Isa.nibbles: each byte's high or low nibble by its qword, with GFNI one vgf2p8affineqb (a bit
    matrix per qword), else a word shift and a mask; the same bytes either way."""
    if not {name, *extra} <= {t.name for t in target.runnable_targets()} | target.host_features():
        pytest.skip(f"host cannot run {name} with {extra}")
    t = target.named_target(name, extra)
    high = [q % 3 == 1 for q in range(n // 8)]
    m = ir.Module()
    k = Kernel(m, "split", ("src", "dst"))
    k.store(Isa(k, t).nibbles(k.load(vec(i8, n), k.arg["src"]), high), k.arg["dst"])
    k.finish()
    assert ("vgf2p8affineqb" in jit.emit_assembly(m, t)) == ("gfni" in extra)
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    P = ctypes.c_void_p
    jit.compile(m, t).function("split", None, [P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])(
        src.ctypes.data, dst.ctypes.data, 1, 0, 1)
    expected = np.where(np.repeat(high, 8), src >> 4, src & 15)
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("name,extra,n", [("avx2", (), 32), ("avx512_vnni", (), 64), ("avx512_vnni", ("gfni",), 64)])
def test_byte_bits_move_a_field_of_each_byte(name, extra, n):
    """Isa.byte_bits: bits shift.. of each byte at bits to.., the rest zero (q6_k's 2-bit fields to bit 4,
    nibbles down, a field in place), with GFNI one vgf2p8affineqb each, else a word shift and a mask."""
    if not {name, *extra} <= {t.name for t in target.runnable_targets()} | target.host_features():
        pytest.skip(f"host cannot run {name} with {extra}")
    t = target.named_target(name, extra)
    fields = [(0, 2, 4), (2, 2, 4), (4, 2, 4), (6, 2, 4), (4, 4, 0), (0, 4, 0), (1, 3, 5)]
    m = ir.Module()
    k = Kernel(m, "fields", ("src", "dst"))
    isa = Isa(k, t)
    v = k.load(vec(i8, n), k.arg["src"])
    for f, (shift, width, to) in enumerate(fields):
        k.store(isa.byte_bits(v, shift, width, to), k.arg["dst"], n * f)
    k.finish()
    assert ("vgf2p8affineqb" in jit.emit_assembly(m, t)) == ("gfni" in extra)
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros((len(fields), n), np.uint8)
    P = ctypes.c_void_p
    jit.compile(m, t).function("fields", None, [P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])(
        src.ctypes.data, dst.ctypes.data, 1, 0, 1)
    for got, (shift, width, to) in zip(dst, fields):
        np.testing.assert_array_equal(got, ((src >> shift) & ((1 << width) - 1)) << to, err_msg=f"{shift, width, to}")


def test_gathered_runs_refuse_what_their_windows_cannot_hold():
    """A gathered run of 32-weight blocks takes an even count spanning at least one 128-byte window
    (gemv gives it whole groups of 8 and decodes a row's last, partial group block by block)."""
    from ggraph.backends.llvm.kernels.qmatmul import block_format
    isa = _isa("avx512_vnni")
    run = block_format(dtypes.q4_0).run
    with pytest.raises(ValueError, match="q4_0: 3 blocks"):
        run(isa.k, isa, isa.k.arg["p"], 3)
    with pytest.raises(ValueError, match="q4_0: 6 blocks .108 bytes"):
        run(isa.k, isa, isa.k.arg["p"], 6)
    with pytest.raises(ValueError, match="in pairs from even ones"):
        run(isa.k, isa, isa.k.arg["p"], 8).weights(1, 2)
    assert block_format(dtypes.q8_0).run is None and block_format(dtypes.q4_k).run is None


# -- what the assembly may contain -------------------------------------------------------------------
def test_avx2_has_no_vnni_and_no_zmm():
    asm = asm_of(q8_0_matmul, q4_k_matmul, name="avx2")
    assert "vpmaddubsw" in asm and "ymm" in asm
    assert "vpdpbusd" not in asm and "zmm" not in asm


def test_avx512_uses_zmm_without_vnni():
    asm = asm_of(q8_0_matmul, q4_k_matmul, name="avx512")
    assert "zmm" in asm and "vpmaddubsw" in asm and "vpdpbusd" not in asm


def test_avx512_vnni_uses_vpdpbusd_on_zmm():
    asm = asm_of(q8_0_matmul, q4_k_matmul, name="avx512_vnni")
    assert re.search(r"vpdpbusd\s+[^\n]*zmm", asm)


def test_gemv_prefetch_is_chosen_by_cpu_vendor():
    """Intel hosts' gemv asks for the next rows' lines at each row's start; AMD hosts' asks for them
    (further ahead) with each group of q4_k / q5_k / 32-weight blocks only, and nowhere for q6_k."""
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    assert (target.prefetch_kind(amd), target.prefetch_kind(intel), target.prefetch_kind("")) == \
        ("spread", "rows", "rows")
    t = target.named_target("avx2")                      # rows_only: the gemv arithmetic alone
    for kind, expected in (("rows", {"q6_k": True, "q4_k": True, "q4_0": True}),
                           ("spread", {"q6_k": False, "q4_k": True, "q4_0": True})):
        for dt in (dtypes.q6_k, dtypes.q4_k, dtypes.q4_0):
            m = ir.Module()
            kernels.qmatmul(m, dt, 1024, 64, dataclasses.replace(t, gemv_prefetch=kind), rows_only=True)
            assert ("prefetch" in jit.emit_assembly(m, t)) == expected[dt.name], (kind, dt.name)
    assert target.host_target().gemv_prefetch == target.host_prefetches()


def test_amx_tiles_take_super_block_types_only():
    asm = asm_of(q4_k_matmul, name="amx")
    assert "ldtilecfg" in asm and re.search(r"tdpbssd\s+%tmm", asm) and "tilerelease" in asm
    assert "vpdpbusd" in asm                              # gemv and the rows gemm below 32 tokens
    assert "tdpbssd" not in asm_of(q8_0_matmul, name="amx")
    d = kernels.describe(target.named_target("amx"))
    assert "AMX tiles" in d["qmatmul q4_k"] and "AMX" not in d["qmatmul q8_0"]


def test_amx_keeps_vpdpwssd_whole():
    """On amx, LLVM is told vpdpwssd is fast: the tile gemm's mins stay one instruction per pair of
    sums, where generic tuning splits all but the first of a chain into vpmaddwd + vpaddd."""
    amx = target.named_target("amx")
    asm = asm_of(q4_k_matmul, name="amx")
    split = r"vpmaddwd\s+%zmm"                                        # (a 128-bit one elsewhere is meant)
    assert asm.count("vpdpwssd") >= 16 and not re.search(split, asm)
    untuned = dataclasses.replace(amx, features=amx.features.replace(",+fast-dpwssd", ""))
    m = ir.Module()
    q4_k_matmul(m, untuned)
    assert re.search(split, jit.emit_assembly(m, untuned))              # what the flag changes


def test_generic_stays_in_sse2():
    asm = asm_of(q8_0_matmul, lambda m, t: kernels.fmatmul(m, dtypes.f16, 64, 16, t), name="generic")
    assert "ymm" not in asm and "zmm" not in asm and "vcvtph2ps" not in asm and "pmaddubsw" not in asm


def test_neon_emits_fmla_and_no_sdot():
    asm = asm_of(lambda m, t: kernels.fmatmul(m, dtypes.f32, 256, 64, t), q8_0_matmul, name="neon")
    assert re.search(r"\bfmla\b", asm) and not re.search(r"\bsdot\b", asm)


def test_neon_dotprod_emits_sdot():
    asm = asm_of(q8_0_matmul, q4_k_matmul, name="neon_dotprod")
    assert re.search(r"\bsdot\b", asm)


def typed_cache_attention(m, t):
    from ggraph.backends.llvm.kernels.attention import Attention, Rope, attention_kernels
    for kt, vt in (("f16", "q8_0"), ("q4_0", "bf16")):
        attention_kernels(m, t, Attention(8, 2, 64, 64, 0.125, k_type=kt, v_type=vt), Rope(64, 1e4))


@pytest.mark.parametrize("name,widen", [("avx512", r"vcvtph2ps\s+[^\n]*zmm"), ("avx2", r"vcvtph2ps\s+[^\n]*ymm"),
                                        ("neon", r"\bfcvtl2?\b"), ("generic", None)])
def test_attention_over_cache_types_builds_for_every_set(name, widen):
    """The f16 / bf16 / q8_0 / q4_0 cache readers and writers build for each set, converting with its own instructions."""
    asm = asm_of(typed_cache_attention, name=name)
    if widen is None:                                   # SSE2 only: integer bit tricks, no F16C
        assert "vcvtph2ps" not in asm and "ymm" not in asm
    else:
        assert re.search(widen, asm), f"{name}: no f16 widening in the attention kernels"


# -- the object-code cache ------------------------------------------------------------------------
@needs("generic")
def test_second_compile_is_a_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path))
    t = target.named_target("generic")

    def build():
        m = ir.Module()
        kernels.fmatmul(m, dtypes.f32, 8, 16, t)
        return m
    first, second = jit.compile(build(), t), jit.compile(build(), t)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert len(list(tmp_path.glob("*.o"))) == 1
    name = "fmatmul_f32_k8_n16_generic"
    w = (ctypes.c_float * 128)(*[1.0] * 128)
    x = (ctypes.c_float * 8)(*range(8))
    y = (ctypes.c_float * 16)()
    P = ctypes.c_void_p
    counter = (ctypes.c_int32 * 16)()
    f = second.function(name, None, [P, P, P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])
    f(ctypes.addressof(w), ctypes.addressof(x), ctypes.addressof(y), ctypes.addressof(counter), 1, 0, 1)
    assert list(y) == [28.0] * 16
    with pytest.raises(KeyError, match="not in this library"):
        second.address("nope")


# -- loading without a system linker ------------------------------------------------------------
_FAR_APART = r'''
import ctypes, sys
from llvmlite import ir
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.target import host_target

jit.system_linker = lambda: None                 # no ld: LLJIT loads it
t = host_target()
m = ir.Module()
m.triple = t.triple
table = ir.GlobalVariable(m, ir.ArrayType(ir.FloatType(), 64), "table")
table.global_constant, table.linkage = True, "private"
table.initializer = ir.Constant(table.type.pointee, [i / 2 for i in range(64)])
k = ir.Function(m, ir.FunctionType(ir.FloatType(), [ir.IntType(32)]), "k")
b = ir.IRBuilder(k.append_basic_block())
total = ir.Constant(ir.FloatType(), 0.0)
for j in range(2000):                        # pages of code, each add reading the table in .rodata
    at = b.and_(b.add(k.args[0], ir.Constant(ir.IntType(32), j)), ir.Constant(ir.IntType(32), 63))
    total = b.fadd(total, b.load(b.gep(table, [ir.Constant(ir.IntType(32), 0), at])))
b.ret(total)
obj, _ = jit.object_code(m, t)

jit._lljit()                                     # made first: its own start-up would take the hole below

# Every gap of the mmap area mapped (PROT_NONE) but its top page, with 3 GB mapped below: a new
# mapping of one page lands at the top, anything larger more than 3 GB below it.
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
ANON, NOREPLACE = 0x22 | 0x4000, 0x100000            # private, anonymous, no swap; MAP_FIXED_NOREPLACE
low = libc.mmap(None, 3 << 30, 0, ANON, -1, 0)


def fill() -> bool:
    """Map every gap between ``low`` and ld.so (the top of the mmap area) but the top page; False
    if another thread mapped something meanwhile."""
    lines = open("/proc/self/maps").read().splitlines()
    ends = [int(line.split()[0].split("-")[1], 16) for line in lines if "ld-linux" in line]
    if not ends:
        print("skip: no ld-linux mapping to find the top of the mmap area by")
        sys.exit(0)
    spans = sorted(tuple(int(v, 16) for v in line.split()[0].split("-")) for line in lines)
    gaps = [(a, b) for (_, a), (b, _) in zip(spans, spans[1:]) if b > a and a >= low and b <= max(ends)]
    top, whole = max(gaps), True
    for lo, hi in gaps:
        hi -= 4096 if (lo, hi) == top else 0
        if hi > lo:
            whole &= libc.mmap(lo, hi - lo, 0, ANON | NOREPLACE, -1, 0) == lo
    return whole


if not any(fill() for _ in range(5)):
    print("skip: other threads kept mapping memory")
    sys.exit(0)
lib = jit.link([obj], ["k"])
print(type(lib._tracker).__name__, lib.function("k", ctypes.c_float, [ctypes.c_int32])(5))
'''


def test_lljit_links_code_and_constants_that_lie_far_apart():
    """Without ``ld``, programs load through LLJIT. Its default linker (RuntimeDyld) maps code and
    constants apart, and llvmlite's LLVM is built with assertions: when the two land more than 2 GB
    apart (a crowded address space, made here on purpose) it aborted the process on a 32-bit
    relocation. JITLink lays a link out in one allocation."""
    import subprocess
    import sys
    if not sys.platform.startswith("linux") or target.host_arch() != "x86_64":
        pytest.skip("the address-space layout is made with Linux's mmap, for x86-64 relocations")
    run = subprocess.run([sys.executable, "-c", _FAR_APART], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    if run.stdout.startswith("skip:"):
        pytest.skip(run.stdout.strip())
    assert run.stdout.split() == ["ResourceTracker", str(sum((5 + j) % 64 / 2 for j in range(2000)))]


def test_one_plan_decides_each_matmul_kernel():
    """plan.qmatmul_plan is the one place that picks a quantised matmul's methods: the rows gemm and one
    activation row per token with AVX-512 VNNI, AMX tiles for super-block types only, rows16 for whole
    32-row tiles of q4_k / q5_k / q6_k, one method at every T for rows_only, the prefetch by vendor."""
    from ggraph.backends.llvm.kernels import rows16
    from ggraph.backends.llvm.kernels.plan import (ROWS16_TYPES, Layout, Method, act_rows, layouts,
                                                   qmatmul_plan)
    vnni, amx, avx2, generic = (target.named_target(n) for n in ("avx512_vnni", "amx", "avx2", "generic"))
    p = qmatmul_plan(dtypes.q4_k, 64, vnni)
    assert (p.one, p.many, p.tiles, p.act_rows, p.layout) == (Method.GEMV, Method.ROWS_GEMM, None, True, Layout.FILE)
    assert qmatmul_plan(dtypes.q4_k, 64, amx).tiles.group == 4 and qmatmul_plan(dtypes.q8_0, 64, amx).tiles is None
    assert qmatmul_plan(dtypes.q4_k, 64, avx2).many is Method.GEMM and not act_rows(avx2)
    assert qmatmul_plan(dtypes.q4_k, 64, avx2, rows_only=True).many is Method.GEMV_ROWS
    assert qmatmul_plan(dtypes.q4_k, 64, vnni, rows_only=True).one is Method.ROWS_GEMM
    assert qmatmul_plan(dtypes.q6_k, 64, generic).one is Method.SCALAR
    assert layouts(dtypes.q4_k, 64, vnni)[0] is Layout.ROWS16 and layouts(dtypes.q4_k, 48, vnni) == (Layout.FILE,)
    assert qmatmul_plan(dtypes.q4_k, 64, vnni, layout="rows16").one is Method.ROWS16_GEMV
    assert set(rows16._KINDS) == set(ROWS16_TYPES)
    amd = dataclasses.replace(avx2, gemv_prefetch="spread")
    assert amd.gemv_prefetch is target.Prefetch.SPREAD
    assert [qmatmul_plan(dt, 64, amd).prefetch for dt in (dtypes.q4_k, dtypes.q6_k, dtypes.q4_0)] == \
        [target.Prefetch.SPREAD, None, target.Prefetch.SPREAD]
    assert qmatmul_plan(dtypes.q6_k, 64, avx2).prefetch is target.Prefetch.ROWS


def test_tile_instructions_need_amx():
    """Kernels emit AMX instructions through Isa.tile, which refuses a target without tiles."""
    k = Kernel(ir.Module(), "no_tiles", ("buf",))
    with pytest.raises(ValueError, match="needs CPU feature 'amx-tile'"):
        Isa(k, target.named_target("avx512_vnni")).tile("tilerelease")
    with pytest.raises(ValueError, match="needs CPU feature 'amx-int8'"):
        Isa(k, target.named_target("avx512_vnni")).tile("tdpbssd", 0, 4, 6)
