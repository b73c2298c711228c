#!/usr/bin/env python3
"""A lane-level model of chunk_state_wgmma.cu's and chunk_state_bwd_wgmma.cu's data movement for
one chunk of one block, on the CPU (session 12's desk check of the kernels, which had no GPU to
run on). The backward: dS^T and -dD^T by stmatrix .trans, dO^T by ldmatrix then stmatrix
.trans, M^T / Qt^T / W^T as register A fragments; dD and the new dS held to a direct computation.

It moves values the way the kernel's threads do: cp.async into 128-byte-swizzled tiles
(sw128_offset), S0^T and D^T written by stmatrix .trans from the accumulator pairs, Kd^T read by
ldmatrix .trans, wgmma reading K-major operands through a descriptor start plus 32-byte k-steps
with 1024 bytes from one 8-row group to the next, register A fragments in the mma.sync m16k16
layout, and the accumulator layout of wgmma.cuh. It then holds D, P, O and the new state to a
direct computation, for K = 64 and 128, with and without Gated DeltaNet's raw path, and with M
formed in the walk (FORM_M: Q K^T masked and decayed, then register A fragments). Small
integers keep every product exact.

What it cannot say: whether the hardware reads a descriptor the way desc_elem() assumes (the
attention kernels' checks on the H200 are the evidence for that), nor anything about barriers.
It catches index-algebra mistakes: swapping the stmatrix row / column offsets or the ldmatrix
lane roles makes it fail. Run: python3 bench/gpu/wgmma_state_model.py (a few seconds).
"""
import random, sys, math
C=64; kTile=8192
def sw(row,col): return row*128 + ((((col>>3) ^ (row&7))<<4) | ((col&7)<<1))
class Smem:
    def __init__(s,n): s.m={}  # byte offset (even) -> value
    def st(s,off,v): assert off%2==0; s.m[off]=v
    def ld(s,off): return s.m[off]
def lanes():
    for tid in range(128):
        yield tid, tid>>5, tid&31, (tid&31)>>2, tid&3
# wgmma smem operand read: desc start = base(1024 aligned)+o, element (row,k) k<16
def desc_elem(sm,start,row,k):
    base=start & ~1023; o=start-base
    # rows: SBO 1024 per 8-row group; inside row: swizzle on 16B chunks of the 128B row
    b=o+2*k; assert b<128
    addr=base+(row//8)*1024+(row%8)*128+(((b>>4)^(row%8))<<4)+(b&15)
    return sm.ld(addr)
def wgmma_ss(d,sm,a_start,b_start,acc,N=64):
    # d: dict per tid list[32]; D(m,n)+=sum_k A(m,k)B(n,k)
    A=[[desc_elem(sm,a_start,m,k) for k in range(16)] for m in range(64)]
    B=[[desc_elem(sm,b_start,n,k) for k in range(16)] for n in range(N)]
    for tid,w,lane,g,t in lanes():
        for j in range(8):
            for e in range(4):
                m=16*w+g+8*(e>>1); n=8*j+2*t+(e&1)
                v=sum(A[m][k]*B[n][k] for k in range(16))
                d[tid][4*j+e]= (d[tid][4*j+e] if acc else 0.0)+v
def wgmma_rs(d,areg,sm,b_start):
    # areg[tid] = 4 regs each (lo,hi) pair; A layout mma.sync m16k16 per warp
    A=[[None]*16 for _ in range(64)]
    for tid,w,lane,g,t in lanes():
        r=areg[tid]
        pos=[(g,2*t),(g+8,2*t),(g,2*t+8),(g+8,2*t+8)]
        for i,(mr,kc) in enumerate(pos):
            A[16*w+mr][kc]=r[i][0]; A[16*w+mr][kc+1]=r[i][1]
    B=[[desc_elem(sm,b_start,n,k) for k in range(16)] for n in range(64)]
    for tid,w,lane,g,t in lanes():
        for j in range(8):
            for e in range(4):
                m=16*w+g+8*(e>>1); n=8*j+2*t+(e&1)
                d[tid][4*j+e]+=sum(A[m][k]*B[n][k] for k in range(16))
def stmatrix_x4_trans(sm,addr_of_tid,regs_of_tid,warp):
    # per warp: lane 8j+i gives addr of stored row i of matrix j; stored row i = fragment column i
    for w in range(4):
        for jm in range(4):
            for i in range(8):
                addr=addr_of_tid[32*w+8*jm+i]
                for gg in range(8):  # fragment row gg -> stored column gg
                    # fragment element (gg, i) held by lane 4*gg + i//2, half i&1
                    lane=4*gg+i//2
                    v=regs_of_tid[32*w+lane][jm][i&1]
                    sm.st(addr+2*gg,v)
def ldmatrix_x4(sm,addr_of_tid,trans=False):
    # lane 8 j + i gives the address of stored row i of matrix j; each lane gets two elements of
    # every matrix: (row lane/4, columns 2 (lane % 4), + 1), of the matrix or, .trans, of its transpose
    out={}
    for w in range(4):
        for jm in range(4):
            rows=[[sm.ld(addr_of_tid[32*w+8*jm+i]+2*c) for c in range(8)] for i in range(8)]
            for lane in range(32):
                g=lane>>2;t=lane&3
                pair=(rows[2*t][g],rows[2*t+1][g]) if trans else (rows[g][2*t],rows[g][2*t+1])
                out.setdefault(32*w+lane,[None]*4)[jm]=pair
    return out
def ldmatrix_x4_trans(sm,addr_of_tid):
    return ldmatrix_x4(sm,addr_of_tid,trans=True)
def run(K,RAW,FORM_M=False,seed=1):
    random.seed(seed)
    MT=K//64; bytes_k=(K//64)*kTile
    off_w=0; off_q=bytes_k; off_u=2*bytes_k; off_m=off_u+kTile; off_kd=off_m+2*kTile
    off_sd=off_kd+2*bytes_k; off_dk=off_sd+kTile
    rnd=lambda: float(random.randint(-4,4))
    W=[[rnd() for _ in range(K)] for _ in range(C)]
    Q=[[rnd() for _ in range(K)] for _ in range(C)]
    U=[[rnd() for _ in range(64)] for _ in range(C)]
    M=[[rnd() if j<=i else 0.0 for j in range(C)] for i in range(C)]
    Kd=[[rnd() for _ in range(K)] for _ in range(C)]
    S0=[[rnd() for _ in range(64)] for _ in range(K)]
    gcv=[float(random.randint(-2,0)) for _ in range(K)]  # exp(G_C) stand-in (non RAW) or G (RAW) first C
    if RAW:
        gcv=[-float(i//8) for i in range(C)]+[0.0]*(K-C)
    sm=Smem(0); buf=0
    def load(dst,X,width):
        for r in range(C):
            for col in range(width):
                sm.st(dst+(col>>6)*kTile+sw(r,col&63),X[r][col])
    load(off_w,W,K); load(off_q,Q,K); load(off_u,U,64); load(off_m+buf*kTile,M,C); load(off_kd+buf*bytes_k,Kd,K)
    # S accumulator per tid
    S={tid:[[0.0]*32 for _ in range(MT)] for tid in range(128)}
    for tid,w,lane,g,t in lanes():
        for mt in range(MT):
            for j in range(8):
                for half in range(2):
                    r=64*mt+16*w+g+8*half;c=8*j+2*t
                    S[tid][mt][4*j+2*half]=S0[r][c]; S[tid][mt][4*j+2*half+1]=S0[r][c+1]
    # S0^T store
    def store_transposed(tile,pairs):
        for kk in range(4):
            addr={};regs={}
            for tid,w,lane,g,t in lanes():
                jj=lane>>3;i=lane&7
                addr[tid]=tile+sw(16*kk+8*(jj>>1)+i,16*w+8*(jj&1))
                p=pairs[tid]
                regs[tid]=[p[2*kk][0],p[2*kk][1],p[2*kk+1][0],p[2*kk+1][1]]
            stmatrix_x4_trans(sm,addr,regs,None)
    for mt in range(MT):
        pairs={}
        for tid in range(128):
            s=S[tid][mt]
            pairs[tid]=[[(s[4*j+2*h],s[4*j+2*h+1]) for h in range(2)] for j in range(8)]
        store_transposed(off_sd+mt*kTile,pairs)
    accD={tid:[0.0]*32 for tid in range(128)}; accP={tid:[0.0]*32 for tid in range(128)}
    accM={tid:[0.0]*32 for tid in range(128)}
    for ks in range(K//16):
        off=(ks>>2)*kTile+(ks&3)*32
        wgmma_ss(accD,sm,off_w+off,off_sd+off,ks>0)
    for ks in range(K//16):
        off=(ks>>2)*kTile+(ks&3)*32
        wgmma_ss(accP,sm,off_q+off,off_sd+off,ks>0)
    kd=off_kd+buf*bytes_k
    if FORM_M:  # RAW: the k rows sit in the Kd buffer; M = Q K^T from the two tiles
        for ks in range(K//16):
            off=(ks>>2)*kTile+(ks&3)*32
            wgmma_ss(accM,sm,off_q+off,kd+off,ks>0)
    # reference
    Dref=[[U[i][n]-sum(W[i][k]*S0[k][n] for k in range(K)) for n in range(64)] for i in range(C)]
    Pref=[[sum(Q[i][k]*S0[k][n] for k in range(K)) for n in range(64)] for i in range(C)]
    gc=gcv
    dpairs={};dkpairs={}
    for tid,w,lane,g,t in lanes():
        dk_f=[1.0,1.0];p_f=[1.0,1.0]
        if RAW:
            glast=gc[C-1]
            for h in range(2):
                gr=gc[16*w+g+8*h]; dk_f[h]=2**(glast-gr); p_f[h]=0.5*2**gr
        dp=[[None,None] for _ in range(8)]; dkp=[[None,None] for _ in range(8)]
        for j in range(8):
            for h in range(2):
                r=16*w+g+8*h;c=8*j+2*t
                u=(sm.ld(off_u+sw(r,c)),sm.ld(off_u+sw(r,c)+2))
                d=(u[0]-accD[tid][4*j+2*h],u[1]-accD[tid][4*j+2*h+1])
                assert abs(d[0]-Dref[r][c])<1e-9 and abs(d[1]-Dref[r][c+1])<1e-9, ("D",r,c)
                assert abs(accP[tid][4*j+2*h]-Pref[r][c])<1e-9
                dp[j][h]=d
                if RAW:
                    dkp[j][h]=(d[0]*dk_f[h],d[1]*dk_f[h])
                    accP[tid][4*j+2*h]*=p_f[h]; accP[tid][4*j+2*h+1]*=p_f[h]
        dpairs[tid]=dp; dkpairs[tid]=dkp
    afm={}
    if FORM_M:  # masked, decayed, scaled: then register A fragments (lo, hi pairs) per 16 columns
        for tid,w,lane,g,t in lanes():
            a=accM[tid]
            for j in range(8):
                for h in range(2):
                    row=16*w+g+8*h
                    for e in range(2):
                        col=8*j+2*t+e
                        a[4*j+2*h+e]=0.5*2**(gc[row]-gc[col])*a[4*j+2*h+e] if col<=row else 0.0
            for J in range(4):
                afm[(tid,J)]=[(a[8*J+2*i],a[8*J+2*i+1]) for i in range(4)]
        Mform=[[0.5*2**(gc[i]-gc[j])*sum(Q[i][k]*Kd[j][k] for k in range(K)) if j<=i else 0.0 for j in range(C)] for i in range(C)]
    store_transposed(off_sd,dpairs)
    if RAW: store_transposed(off_dk,dkpairs)
    sDkT=off_dk if RAW else off_sd
    akd={}
    for mt in range(MT):
        for J in range(4):
            addr={}
            for tid,w,lane,g,t in lanes():
                m0=64*mt+16*w; k0=16*J
                r=k0+(lane&7)+(lane>>4)*8; c=m0+((lane>>3)&1)*8
                addr[tid]=kd+(c>>6)*kTile+sw(r,c&63)
            res=ldmatrix_x4_trans(sm,addr)
            for tid in range(128): akd[(tid,mt,J)]=res[tid]
    for tid,w,lane,g,t in lanes():
        for mt in range(MT):
            m0=64*mt+16*w
            if RAW: ga=gb=2**gc[C-1]
            else: ga=gc[m0+g]; gb=gc[m0+g+8]
            for j in range(8):
                S[tid][mt][4*j]*=ga;S[tid][mt][4*j+1]*=ga;S[tid][mt][4*j+2]*=gb;S[tid][mt][4*j+3]*=gb
    m=off_m+buf*kTile
    if FORM_M:
        for J in range(4): wgmma_rs(accP,{tid:afm[(tid,J)] for tid in range(128)},sm,off_sd+J*32)
        M=Mform
    else:
        for J in range(4): wgmma_ss(accP,sm,m+J*32,off_sd+J*32,1)
    for mt in range(MT):
        Smt={tid:S[tid][mt] for tid in range(128)}
        for J in range(4):
            wgmma_rs(Smt,{tid:akd[(tid,mt,J)] for tid in range(128)},sm,sDkT+J*32)
    # references
    if RAW:
        Dk=[[Dref[i][n]*2**(gc[C-1]-gc[i]) for n in range(64)] for i in range(C)]
        Oref=[[0.5*2**gc[i]*Pref[i][n]+sum(M[i][j]*Dref[j][n] for j in range(C)) for n in range(64)] for i in range(C)]
        Sref=[[2**gc[C-1]*S0[k][n]+sum(Kd[j][k]*Dk[j][n] for j in range(C)) for n in range(64)] for k in range(K)]
    else:
        Oref=[[Pref[i][n]+sum(M[i][j]*Dref[j][n] for j in range(C)) for n in range(64)] for i in range(C)]
        Sref=[[gc[k]*S0[k][n]+sum(Kd[j][k]*Dref[j][n] for j in range(C)) for n in range(64)] for k in range(K)]
    for tid,w,lane,g,t in lanes():
        for j in range(8):
            for h in range(2):
                r=16*w+g+8*h;c=8*j+2*t
                for e in range(2):
                    assert abs(accP[tid][4*j+2*h+e]-Oref[r][c+e])<1e-6*max(1,abs(Oref[r][c+e])),("O",r,c+e)
                for mt in range(MT):
                    rr=64*mt+r
                    for e in range(2):
                        assert abs(S[tid][mt][4*j+2*h+e]-Sref[rr][c+e])<1e-6*max(1,abs(Sref[rr][c+e])),("S",rr,c+e,S[tid][mt][4*j+2*h+e],Sref[rr][c+e])
    print("ok K=%d RAW=%s FORM_M=%s"%(K,RAW,FORM_M))
def store_transposed_frags(sm,tile,frags,row0_of_warp,col0):
    # frags[tid] = 4 (lo, hi) pairs in the m16k16 fragment order; chunk_wgmma.cuh's
    # store_fragment_transposed
    addr={}
    for tid,w,lane,g,t in lanes():
        jj=lane>>3;i=lane&7
        addr[tid]=tile+sw(col0+8*(jj>>1)+i,row0_of_warp(w)+8*(jj&1))
    stmatrix_x4_trans(sm,addr,frags,None)
def run_bwd(K,seed=3):
    # chunk_state_bwd_wgmma.cu, one chunk: dD = Kd dS + M^T dO, dS' = gC dS + Qt^T dO - W^T dD
    random.seed(seed)
    MT=K//64; bytes_k=(K//64)*kTile
    off_w=0; off_q=bytes_k; off_kd=2*bytes_k; off_m=3*bytes_k; off_do=off_m+kTile
    off_dot=off_do+kTile; off_ds=off_dot+kTile
    rnd=lambda: float(random.randint(-3,3))
    W=[[rnd() for _ in range(K)] for _ in range(C)]
    Qt=[[rnd() for _ in range(K)] for _ in range(C)]
    Kd=[[rnd() for _ in range(K)] for _ in range(C)]
    M=[[rnd() if j<=i else 0.0 for j in range(C)] for i in range(C)]
    dO=[[rnd() for _ in range(64)] for _ in range(C)]
    dS0=[[rnd() for _ in range(64)] for _ in range(K)]
    gc=[float(random.randint(0,2)) for _ in range(K)]
    sm=Smem(0)
    def load(dst,X,width):
        for r in range(len(X)):
            for col in range(width):
                sm.st(dst+(col>>6)*kTile+sw(r,col&63),X[r][col])
    load(off_w,W,K); load(off_q,Qt,K); load(off_kd,Kd,K); load(off_m,M,C); load(off_do,dO,64)
    dS={tid:[[0.0]*32 for _ in range(MT)] for tid in range(128)}
    for tid,w,lane,g,t in lanes():
        for mt in range(MT):
            for j in range(8):
                for h in range(2):
                    r=64*mt+16*w+g+8*h;c=8*j+2*t
                    dS[tid][mt][4*j+2*h]=dS0[r][c]; dS[tid][mt][4*j+2*h+1]=dS0[r][c+1]
    # dS^T
    for mt in range(MT):
        frags_by_kk=[{} for _ in range(4)]
        for tid in range(128):
            s_=dS[tid][mt]
            pairs=[[(s_[4*j+2*h],s_[4*j+2*h+1]) for h in range(2)] for j in range(8)]
            for kk in range(4):
                frags_by_kk[kk][tid]=[pairs[2*kk][0],pairs[2*kk][1],pairs[2*kk+1][0],pairs[2*kk+1][1]]
        for kk in range(4):
            store_transposed_frags(sm,off_ds+mt*kTile,frags_by_kk[kk],lambda w:16*w,16*kk)
    # dO^T: ldmatrix (no trans) of the warp's 16 rows, then stmatrix .trans
    for kk in range(4):
        addr={}
        for tid,w,lane,g,t in lanes():
            r=16*w+(lane&7)+((lane>>3)&1)*8; c=16*kk+(lane>>4)*8
            addr[tid]=off_do+sw(r,c)
        fr=ldmatrix_x4(sm,addr)
        store_transposed_frags(sm,off_dot,fr,lambda w:16*w,16*kk)
    # dD
    am={}
    for J in range(4):
        addr={}
        for tid,w,lane,g,t in lanes():
            m0=16*w;k0=16*J
            r=k0+(lane&7)+(lane>>4)*8; c=m0+((lane>>3)&1)*8
            addr[tid]=off_m+(c>>6)*kTile+sw(r,c&63)
        res=ldmatrix_x4_trans(sm,addr)
        for tid in range(128): am[(tid,J)]=res[tid]
    accD={tid:[0.0]*32 for tid in range(128)}
    for ks in range(K//16):
        off=(ks>>2)*kTile+(ks&3)*32
        wgmma_ss(accD,sm,off_kd+off,off_ds+off,ks>0)
    for J in range(4): wgmma_rs(accD,{tid:am[(tid,J)] for tid in range(128)},sm,off_dot+J*32)
    Dref=[[sum(Kd[i][k]*dS0[k][c] for k in range(K))+sum(M[j][i]*dO[j][c] for j in range(C)) for c in range(64)] for i in range(C)]
    npairs={}
    for tid,w,lane,g,t in lanes():
        p_=[[None,None] for _ in range(8)]
        for j in range(8):
            for h in range(2):
                r=16*w+g+8*h;c=8*j+2*t
                for e in range(2):
                    assert accD[tid][4*j+2*h+e]==Dref[r][c+e],("dD",r,c+e)
                p_[j][h]=(-accD[tid][4*j+2*h],-accD[tid][4*j+2*h+1])
        npairs[tid]=p_
    for kk in range(4):
        fr={tid:[npairs[tid][2*kk][0],npairs[tid][2*kk][1],npairs[tid][2*kk+1][0],npairs[tid][2*kk+1][1]] for tid in range(128)}
        store_transposed_frags(sm,off_ds,fr,lambda w:16*w,16*kk)
    # dS update
    for mt in range(MT):
        aq={};aw={}
        for J in range(4):
            addr={}
            for tid,w,lane,g,t in lanes():
                m0=64*mt+16*w;k0=16*J
                r=k0+(lane&7)+(lane>>4)*8; c=m0+((lane>>3)&1)*8
                addr[tid]=(c>>6)*kTile+sw(r,c&63)
            rq=ldmatrix_x4_trans(sm,{tid:off_q+a for tid,a in addr.items()})
            rw=ldmatrix_x4_trans(sm,{tid:off_w+a for tid,a in addr.items()})
            for tid in range(128): aq[(tid,J)]=rq[tid]; aw[(tid,J)]=rw[tid]
        for tid,w,lane,g,t in lanes():
            m0=64*mt+16*w; ga=gc[m0+g]; gb=gc[m0+g+8]
            for j in range(8):
                dS[tid][mt][4*j]*=ga;dS[tid][mt][4*j+1]*=ga;dS[tid][mt][4*j+2]*=gb;dS[tid][mt][4*j+3]*=gb
        Smt={tid:dS[tid][mt] for tid in range(128)}
        for J in range(4):
            wgmma_rs(Smt,{tid:aq[(tid,J)] for tid in range(128)},sm,off_dot+J*32)
            wgmma_rs(Smt,{tid:aw[(tid,J)] for tid in range(128)},sm,off_ds+J*32)
    Sref=[[gc[k]*dS0[k][c]+sum(Qt[j][k]*dO[j][c] for j in range(C))-sum(W[j][k]*Dref[j][c] for j in range(C)) for c in range(64)] for k in range(K)]
    for tid,w,lane,g,t in lanes():
        for mt in range(MT):
            for j in range(8):
                for h in range(2):
                    r=64*mt+16*w+g+8*h;c=8*j+2*t
                    for e in range(2):
                        assert dS[tid][mt][4*j+2*h+e]==Sref[r][c+e],("dS",r,c+e)
    print("ok backward K=%d"%K)
for K in (64,128):
    for RAW,FORM_M in ((False,False),(True,False),(True,True)):
        run(K,RAW,FORM_M)
for K in (64,128):
    run_bwd(K)
