import pickle, sys, shimc
d=pickle.load(open(sys.argv[1],'rb')); raw=d['raw']
p=shimc.Proc(d['pid'], d['maps'])
for _ in range(int(sys.argv[2])):
    for r in raw: p.unwind(*r[:3])
