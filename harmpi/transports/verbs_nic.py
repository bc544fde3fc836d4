"""The NIC adapter of the verbs transport: the only code that calls pyverbs.

:func:`probe` lists devices and ports as plain records (verbs_proto.DeviceInfo)
and picks one; :class:`PyverbsNic` opens it and offers the few operations the
rail protocol uses (harmpi.transports.verbs lists them). Nothing here is
reached without an RDMA device, so none of it runs on the development
machines (their kernels have no RDMA support): tests marked ``verbs_device``
run it on a host that has one (``make test-verbs``).

Queue pair transitions, with the values of verbs_proto:
  INIT: port, pkey index 0, access LOCAL_WRITE | REMOTE_WRITE (peers write
        into the landing ring and the credit words; no reads, no atomics);
  RTR:  the peer's QP number and first PSN, path MTU = the smaller of both
        ports' active MTU, 1 outstanding read as responder, min RNR timer
        QP_MIN_RNR_TIMER; the address: the peer's LID, plus a GRH with the
        peer's GID and our GID index when our port is addressed by GID
        (RoCE), hop limit 64;
  RTS:  our first PSN, local ACK timeout QP_TIMEOUT, QP_RETRY_CNT transport
        retries, QP_RNR_RETRY RNR retries, 1 outstanding read as initiator.
"""

from __future__ import annotations

import numpy as np

from . import verbs_proto as proto

__all__ = ["probe", "PyverbsNic", "qp_attr", "set_rtr", "set_rts", "recv_wr", "write_wr"]


def _name(dev):
    return dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)


def _gid_bytes(gid):
    """16 bytes of a pyverbs GID (its str is 8 colon-separated words)."""
    words = str(gid).split(":")
    return b"".join(int(w or "0", 16).to_bytes(2, "big") for w in words)


def _gid_str(raw):
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def _port_info(ctx, num):
    attr = ctx.query_port(num)
    gids = []
    for idx in range(attr.gid_tbl_len):
        try:
            raw = _gid_bytes(ctx.query_gid(num, idx))
        except Exception:  # noqa: BLE001 - an unreadable entry is skipped  # pyverbs error
            continue
        if not any(raw):
            continue
        try:
            typ = int(ctx.query_gid_type(num, idx))
        except Exception:  # noqa: BLE001 - InfiniBand ports have no GID types
            typ = 0
        gids.append((idx, raw, typ))
    return proto.PortInfo(num=num, state=int(attr.state), link_layer=int(attr.link_layer),
                          lid=int(attr.lid), mtu=int(attr.active_mtu), gids=tuple(gids))


def list_devices():
    """[DeviceInfo] of every RDMA device (pyverbs errors propagate: no device
    raises PyverbsRDMAError)."""
    from pyverbs import device  # noqa: PLC0415 - optional dependency

    out = []
    for dev in device.get_device_list():
        name = _name(dev)
        with device.Context(name=name) as ctx:
            nports = ctx.query_device().phys_port_cnt
            out.append(proto.DeviceInfo(name, tuple(_port_info(ctx, n)
                                                    for n in range(1, nports + 1))))
    return out


def probe(device=None, port=None, gid_index=None):
    """(PortChoice or None, what was looked for, what was found)."""
    try:
        devices = list_devices()
    except ImportError as exc:
        return None, "pyverbs", f"pyverbs is not importable ({exc})"
    except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError when no device exists
        return None, "an RDMA device", f"no RDMA device ({type(exc).__name__}: {exc})"
    if not devices:
        return None, "an RDMA device", "no RDMA device (pyverbs lists none)"
    return proto.choose_port(devices, device, port, gid_index)


# -- the pyverbs objects the adapter builds (no device needed to build them:
#    tests/test_verbs_device.py checks them against the installed pyverbs)

def qp_attr(port_num, path_mtu):
    """The QPAttr that moves a QP to INIT (more fields are set for RTR/RTS)."""
    from pyverbs import enums, qp  # noqa: PLC0415 - optional dependency

    attr = qp.QPAttr()
    attr.port_num = port_num
    attr.path_mtu = path_mtu
    attr.qp_access_flags = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_WRITE
    attr.pkey_index = 0
    return attr


def set_rtr(attr, port: proto.PortChoice, remote: proto.ConnInfo):
    """INIT -> RTR fields of ``attr``: the peer's QP, PSN and address."""
    from pyverbs import addr  # noqa: PLC0415

    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = proto.QP_MIN_RNR_TIMER
    if port.gid_index >= 0:
        gr = addr.GlobalRoute(dgid=addr.GID(_gid_str(remote.gid)), sgid_index=port.gid_index,
                              hop_limit=64)
        attr.ah_attr = addr.AHAttr(dlid=remote.lid, is_global=1, port_num=port.port, gr=gr)
    else:
        attr.ah_attr = addr.AHAttr(dlid=remote.lid, port_num=port.port)
    return attr


def set_rts(attr, psn):
    """RTR -> RTS fields of ``attr``: our PSN, ACK timeout and retries."""
    attr.sq_psn = psn
    attr.timeout = proto.QP_TIMEOUT
    attr.retry_cnt = proto.QP_RETRY_CNT
    attr.rnr_retry = proto.QP_RNR_RETRY
    attr.max_rd_atomic = 1
    return attr


def recv_wr(wr_id, addr_, lkey):
    """A receive for a WRITE WITH IMM: the write lands where its sender
    aimed it, the receive only carries the immediate; pyverbs refuses a
    receive without a scatter entry, so it names a small registered scratch
    that nothing is written to."""
    from pyverbs import wr  # noqa: PLC0415

    return wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[wr.SGE(addr_, _SCRATCH_NBYTES, lkey)])


def write_wr(wr_id, addr_, nbytes, lkey, remote_addr, rkey, imm):
    """A signaled RDMA WRITE (``imm`` None) or WRITE WITH IMM of nbytes at addr_."""
    from pyverbs import enums, wr  # noqa: PLC0415

    sge = wr.SGE(addr_, nbytes, lkey)
    if imm is None:
        w = wr.SendWR(wr_id=wr_id, opcode=enums.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                      send_flags=enums.IBV_SEND_SIGNALED)
    else:
        w = wr.SendWR(wr_id=wr_id, opcode=enums.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
                      sg=[sge], imm_data=imm, send_flags=enums.IBV_SEND_SIGNALED)
    w.set_wr_rdma(rkey, remote_addr)
    return w


_SCRATCH_NBYTES = 64


class _Qp:
    """A pyverbs QP and its number (pyverbs' QP takes no new attributes)."""

    __slots__ = ("qp", "qpn")

    def __init__(self, q):
        self.qp, self.qpn = q, q.qp_num


class _Region:
    __slots__ = ("buf", "addr", "lkey", "rkey", "mr")

    def __init__(self, buf, mr):
        self.buf, self.mr = buf, mr
        self.addr = buf.ctypes.data
        self.lkey, self.rkey = mr.lkey, mr.rkey


class PyverbsNic:
    """One device context, PD and CQ; QPs and memory regions made on request."""

    def __init__(self, choice: proto.PortChoice, cq_depth=1024):
        from pyverbs import cq, device, pd  # noqa: PLC0415 - optional dependency

        self.port = choice
        self._objs = []
        self.ctx = device.Context(name=choice.device)
        self.pd = pd.PD(self.ctx)
        self.cq = cq.CQ(self.ctx, cq_depth, None, None, 0)
        self._objs = [self.cq, self.pd, self.ctx]
        self._qps, self._mrs = [], []
        self._scratch = self.register(_SCRATCH_NBYTES)  # receives' scatter entry

    def register(self, nbytes):
        from pyverbs import enums, mr  # noqa: PLC0415

        # page-aligned numpy memory, registered where it is (buf.base keeps
        # the allocation alive as long as the region)
        raw = np.zeros(nbytes + 4096, np.uint8)
        start = (-raw.ctypes.data) % 4096
        buf = raw[start: start + nbytes]
        access = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_WRITE
        region = _Region(buf, mr.MR(self.pd, nbytes, access, address=buf.ctypes.data))
        self._mrs.append(region.mr)
        return region

    def create_qp(self, send_depth, recv_depth):
        from pyverbs import enums, qp  # noqa: PLC0415

        cap = qp.QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1,
                       max_recv_sge=1)
        init = qp.QPInitAttr(qp_type=enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                             sq_sig_all=0)
        q = _Qp(qp.QP(self.pd, init))
        self._qps.append(q.qp)
        return q

    def connect(self, q, psn, remote: proto.ConnInfo):
        attr = qp_attr(self.port.port, min(self.port.mtu, remote.mtu))
        q.qp.to_init(attr)
        q.qp.to_rtr(set_rtr(attr, self.port, remote))
        q.qp.to_rts(set_rts(attr, psn))

    def post_recv(self, q, wr_id):
        q.qp.post_recv(recv_wr(wr_id, self._scratch.addr, self._scratch.lkey))

    def post_write(self, q, wr_id, region, offset, nbytes, remote_addr, rkey, imm):
        q.qp.post_send(write_wr(wr_id, region.addr + offset, nbytes, region.lkey, remote_addr,
                                rkey, imm))

    def poll(self, max_n):
        n, wcs = self.cq.poll(max_n)
        return [(wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data, wc.vendor_err)
                for wc in wcs[:n]]

    def close(self):
        for obj in self._qps + self._mrs + self._objs:
            try:
                obj.close()
            except Exception:  # noqa: BLE001, S110 - closing what may already be closed
                pass
        self._qps, self._mrs, self._objs = [], [], []
